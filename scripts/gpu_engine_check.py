"""GPU part of scripts/gpu_check.sh: engine parity on CUDA and decode-attention bandwidth.

1. Tiny random-weight Llama-3 and Qwen3 checkpoints (head dims the Triton kernels support):
   greedy ids of the engine on CUDA in float32, with CUDA graphs and eagerly, and with
   attention_impl triton (named, not auto) and cpu (the torch gather + SDPA path on CUDA
   tensors), checked token by token against transformers (tests/oracle.py).
2. paged_decode_attention timed at several batch sizes and context lengths; bytes of K/V read
   per second as a fraction of a device-to-device copy measured in the same run.
"""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagecli import LLM, SamplingParams  # noqa: E402
from pagecli_kernels import paged_decode_attention  # noqa: E402
from tests.oracle import check_greedy  # noqa: E402

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def tiny_checkpoints(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    )
    configs = {
        "llama3": LlamaConfig(
            **common,
            num_key_value_heads=2,
            head_dim=64,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        "qwen3": Qwen3Config(
            **common, num_key_value_heads=1, head_dim=128, tie_word_embeddings=True
        ),
    }
    paths = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" not in pname:
                    p.normal_(0.0, 0.08 if "embed" not in pname else 1.0)
        model.save_pretrained(str(root / name))
        paths[name] = root / name
    return paths


def parity(root: Path) -> None:
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    lengths = [1, 5, 17, 64, 200, 333, 700]
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for name, path in tiny_checkpoints(root).items():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        modes = [("auto", False), ("auto", True), ("triton", False), ("cpu", True)]
        for impl, eager in modes:
            llm = LLM(
                str(path),
                device="cuda",
                dtype="float32",
                block_size=16,
                max_num_batched_tokens=256,
                enforce_eager=eager,
                attention_impl=impl,
            )
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            notes = []
            for p, o in zip(prompts, outs):
                notes += check_greedy(hf, p, o.token_ids)
            mode = f"{impl:6s} " + ("eager" if eager else "cuda graphs")
            print(
                f"parity {name:7s} {mode:18s}: OK ({len(prompts)} prompts, near-ties: {len(notes)})"
            )
            del llm
            torch.cuda.empty_cache()


def timed(fn, reps: int = 20) -> float:
    """Median seconds of fn() measured with CUDA events."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def bandwidth() -> None:
    n = 1 << 30  # 1 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = timed(functools.partial(dst.copy_, src))
    copy_bw = 2 * n / copy_s  # read + write
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    del src, dst
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    dtype = torch.bfloat16
    print("batch  context  time_us  GB/s  fraction_of_copy")
    for batch in (1, 8, 32, 128):
        for context in (1024, 4096, 16384):
            blocks_per_seq = context // block_size
            num_blocks = batch * blocks_per_seq
            k = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
            v = torch.randn_like(k)
            tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
            tables = tables.to(torch.int32).view(batch, blocks_per_seq)
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, heads, head_dim, dtype=dtype, device="cuda")
            seconds = timed(
                functools.partial(paged_decode_attention, q, k, v, tables, lens, head_dim**-0.5)
            )
            read = 2 * batch * context * kv_heads * head_dim * k.element_size()
            bw = read / seconds
            print(
                f"{batch:5d} {context:8d} {seconds * 1e6:8.1f} {bw / 1e9:6.0f} {bw / copy_bw:6.2f}"
            )
            del k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        try:
            parity(Path(tmp))
        except Exception as exc:  # report and go on to the timings
            print(f"parity FAILED: {type(exc).__name__}: {exc}")
    bandwidth()
