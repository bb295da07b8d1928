"""Decode steps of the engine against their floor, and the host overhead per step (a script).

For each dtype (float32, and bfloat16 unless --dtypes says otherwise), on the default model:

- the machine's read bandwidth, sampled right after every timed step (a float32 sum over
  --bandwidth-mib, the faster of two passes), and the matmul rate of the model's own gate/up
  projection at the batch size (same kernel, packed or not, as the engine runs);
- a 64-sequence decode step at ~300-token contexts: measured against its floor,
      floor = max(weight bytes / bandwidth, linear FLOPs / matmul rate) + KV bytes / bandwidth
  (the linear layers are bound by memory or arithmetic, whichever is slower; every cached
  K/V row is read once);
- a batch-1 decode step against its weight-bandwidth floor (weight bytes / bandwidth);
- the host overhead of each: step time minus the time inside the attention kernels and the
  matmuls (linear layers and the output projection), both timed around their calls.

Each step is set against the bandwidth sampled just after it, and "x floor" is the median of
those per-step ratios: this guest's read bandwidth swings between about 35 and 75 GB/s from
one minute to the next with its neighbours' load, so a bandwidth measured once, minutes
before the steps, made the ratio a measure of that swing (a float32 batch-1 step once came
out at 0.8x its "floor"). The table also gives the median step, the median floor and the
range of the samples. The matmul rate is the best of several runs.

    .venv/bin/python benchmarks/step_floor.py [--dtypes float32,bfloat16] [--steps 10]

Prints one table to stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import pagecli_kernels
from pagecli import LLM, SamplingParams
from pagecli.layers import linear as linear_module
from pagecli.layers import quant_linear as quant_module
from pagecli.models.llama import LlamaForCausalLM
from pagecli_kernels import layers_cpu
from pagecli_kernels.settings import kernel_settings

TARGET_RATIO_64, TARGET_RATIO_1 = 2.0, 1.5
clock = time.perf_counter  # --clock thread: this thread's CPU time (with --threads 1 only)
TARGET_HOST_MS = {1: 3.0, 64: 8.0}


def note(text: str) -> None:
    print(f"step_floor: {text}", file=sys.stderr, flush=True)


def best_ms(fn, repeats: int) -> float:
    """Fastest of `repeats` calls after a warm-up, in ms: what the machine can do (the
    median of a shared machine measures its neighbours too)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Timers:
    """Wall time spent inside the attention ops and the matmuls, by patching their entry
    points (the attention layer looks the ops up on pagecli_kernels at every call)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self._undo: list = []
        self._timing = kernel_settings(timing=True)  # the one-call layers time their kernels
        self._depth = [0]  # only the outermost timed call counts (a head inside a head)

    def _wrap(self, owner, name: str, key: str) -> None:
        original = getattr(owner, name)
        spent, depth = self.spent, self._depth

        def timed(*args, **kwargs):
            if depth[0]:
                return original(*args, **kwargs)
            depth[0] += 1
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent[key] += clock() - start
                depth[0] -= 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def clear(self) -> None:
        self.spent.clear()
        layers_cpu.reset_kernel_seconds()

    def collected(self) -> dict[str, float]:
        spent = dict(self.spent)
        for key, seconds in layers_cpu.kernel_seconds().items():
            spent[key] = spent.get(key, 0.0) + seconds
        return spent

    def __enter__(self) -> Timers:
        for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
            self._wrap(pagecli_kernels, name, "attention")
        self._wrap(linear_module.PackedLinear, "forward", "matmul")
        self._wrap(linear_module.BF16Linear, "forward", "matmul")
        self._wrap(torch.nn.Linear, "forward", "matmul")
        self._wrap(quant_module.QuantLinear, "forward", "matmul")
        self._wrap(quant_module.QuantEmbedding, "as_linear", "matmul")  # the tied head
        self._wrap(LlamaForCausalLM, "compute_logits", "matmul")  # whichever head it is
        self._timing.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._timing.__exit__(*exc)


def model_sizes(llm: LLM) -> tuple[int, int, int]:
    """(linear weight bytes incl. the output projection, linear params, bytes per element)."""
    model = llm.engine.runner.model
    cfg = llm.engine.hf_config
    attn = model.layers[0].self_attn
    per_layer = cfg.hidden_size * (attn.q_size + 2 * attn.kv_size) + attn.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size
    elem = torch.tensor([], dtype=llm.engine.dtype).element_size()
    quantized = [
        m
        for m in model.modules()
        if isinstance(m, (quant_module.QuantLinear, quant_module.QuantEmbedding))
    ]
    if quantized:  # GGUF blocks kept as they are: the bytes they really take
        floats = params * elem - sum(
            (m.in_features * m.out_features if isinstance(m, quant_module.QuantLinear) else 0)
            * elem
            for m in quantized
        )
        head = [m for m in quantized if isinstance(m, quant_module.QuantEmbedding)]
        if head:  # the tied head streams the whole table
            floats -= cfg.vocab_size * cfg.hidden_size * elem
        return floats + sum(m.nbytes for m in quantized), params, elem
    return params * elem, params, elem


def matmul_rate(llm: LLM, rows: int) -> float:
    """FLOP/s of the model's first gate/up projection on `rows` rows."""
    proj = llm.engine.runner.model.layers[0].mlp.gate_up_proj
    cfg = llm.engine.hf_config
    x = torch.randn(rows, cfg.hidden_size, dtype=llm.engine.dtype)
    with torch.inference_mode():
        ms = best_ms(lambda: proj(x), 30)
    return 2 * rows * cfg.hidden_size * 2 * cfg.intermediate_size / (ms / 1e3)


def decode_steps(
    llm: LLM, num_seqs: int, prompt_len: int, steps: int, bandwidth_mib: int
) -> list[dict]:
    """One record per decode step with `num_seqs` sequences at `prompt_len`-token contexts:
    its wall time and the time in attention and in matmuls (seconds), and the read bandwidth
    sampled right after it (bytes/s)."""
    sample = torch.ones(bandwidth_mib * 2**20 // 4)  # [n] float32
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    vocab = engine.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(num_seqs):
        ids = torch.randint(100, vocab - 100, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}-{time.monotonic_ns()}", ids, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()  # prefills, until every sequence decodes
    engine.step()  # one warm decode step
    records = []
    with Timers() as timers:
        for _ in range(steps):
            timers.clear()
            start = clock()
            engine.step()
            took = clock() - start
            spent = timers.collected()
            bandwidth = sample.numel() * 4 / (min(_timed(sample.sum) for _ in range(2)))
            records.append({"step": took, "bandwidth": bandwidth, **spent})
    while engine.scheduler.has_unfinished():
        engine.step()
    return records


def floor_seconds(
    bandwidth: float, batch: int, weight_bytes: float, flops: float, kv_bytes: float, rate: float
) -> float:
    """A decode step's floor at `bandwidth` (the module docstring's formula); batch 1: the
    weights' bytes only."""
    if batch == 1:
        return weight_bytes / bandwidth
    return max(weight_bytes / bandwidth, flops / rate) + kv_bytes / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--bandwidth-mib", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--quantization",
        default="none",
        help="none (default): float weights in --dtypes, as issue 14 measures them; auto: the "
        "GGUF's own blocks (issue 13)",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="thread: time steps by this thread's CPU time, immune to neighbours' load on a "
        "shared machine (only meaningful with --threads 1)",
    )
    args = parser.parse_args()
    global clock
    if args.clock == "thread":
        clock = time.thread_time

    samples: list[float] = []  # the bandwidth sampled after every timed step
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    rows = []
    for dtype in args.dtypes.split(","):
        note(f"loading the default model in {dtype}")
        llm = LLM(
            None,
            dtype=dtype,
            num_threads=args.threads,
            max_num_seqs=64,
            quantization=args.quantization,
        )
        weight_bytes, params, elem = model_sizes(llm)
        cfg = llm.engine.hf_config
        head_dim = llm.engine.runner.head_dim
        kv_per_token = 2 * cfg.num_hidden_layers * llm.engine.runner.num_kv_heads * head_dim * elem
        for batch in (64, 1):
            rate = matmul_rate(llm, batch)
            note(f"{dtype}: {batch} sequences x {args.context} tokens, {args.steps} steps")
            records = decode_steps(llm, batch, args.context, args.steps, args.bandwidth_mib)
            step = statistics.median(r["step"] for r in records)
            samples += [r["bandwidth"] for r in records]
            spent = {
                key: statistics.median(r.get(key, 0.0) for r in records)
                for key in ("attention", "matmul")
            }
            context = args.context + args.steps / 2 + 1  # mean context over the timed steps
            kv_bytes = batch * context * kv_per_token
            sizes = (batch, weight_bytes, 2 * batch * params, kv_bytes, rate)
            floor = statistics.median(floor_seconds(r["bandwidth"], *sizes) for r in records)
            ratio = statistics.median(
                r["step"] / floor_seconds(r["bandwidth"], *sizes) for r in records
            )
            host = statistics.median(
                r["step"] - r.get("attention", 0.0) - r.get("matmul", 0.0) for r in records
            )
            rows.append(
                dict(
                    dtype=dtype,
                    batch=batch,
                    step_ms=step * 1e3,
                    floor_ms=floor * 1e3,
                    ratio=ratio,
                    target=TARGET_RATIO_64 if batch > 1 else TARGET_RATIO_1,
                    attention_ms=spent.get("attention", 0.0) * 1e3,
                    matmul_ms=spent.get("matmul", 0.0) * 1e3,
                    host_ms=host * 1e3,
                    host_target=TARGET_HOST_MS[batch],
                    gflops=rate / 1e9,
                    weight_mb=weight_bytes / 1e6,
                    kv_mb=kv_bytes / 1e6,
                )
            )
        del llm

    print(
        f"{cpu}, {torch.get_num_threads()} threads, {args.clock} clock; read bandwidth after "
        f"each step: median {statistics.median(samples) / 1e9:.1f} GB/s "
        f"({min(samples) / 1e9:.1f}-{max(samples) / 1e9:.1f})"
    )
    print(
        f"{'dtype':<9}{'batch':>6}{'step ms':>9}{'floor ms':>9}{'x floor':>8}{'target':>7}"
        f"{'attn ms':>9}{'matmul ms':>10}{'host ms':>9}{'target':>7}{'GFLOP/s':>9}"
        f"{'weights MB':>11}{'KV MB':>8}"
    )
    for r in rows:
        print(
            f"{r['dtype']:<9}{r['batch']:>6}{r['step_ms']:>9.1f}{r['floor_ms']:>9.1f}"
            f"{r['ratio']:>7.2f}x{r['target']:>6.1f}x{r['attention_ms']:>9.1f}"
            f"{r['matmul_ms']:>10.1f}{r['host_ms']:>9.1f}{r['host_target']:>7.0f}"
            f"{r['gflops']:>9.0f}{r['weight_mb']:>11.0f}{r['kv_mb']:>8.0f}"
        )


if __name__ == "__main__":
    main()
