"""The engine through the Triton kernels, run by Triton's interpreter on CPU tensors.

attention_impl="triton" sends every store_kv and paged attention call of the model to the
Triton launchers, so the engine's real metadata (block tables of each step's width, int32
lengths, query_start_loc, strided per-layer cache views) meets the kernels as it would on a
GPU. A tiny Llama-3 config (head_dim 64, GQA group 2) runs chunked prefill, a prefix-cache
hit, recompute preemption and decode, with greedy parity against transformers.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.oracle import check_greedy
from tests.tiny_models import VOCAB

# Read when a @triton.jit function is decorated, i.e. when pagecli_kernels first imports a
# kernel module (lazily, on the first impl="triton" call): setting it at collection is enough.
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

NEW_TOKENS = 16


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """Counts the calls of `module.name` (a launcher) in a one-element list."""
    calls = [0]
    launcher = getattr(module, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return launcher(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_engine_through_triton_kernels_matches_transformers(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama3_hd64"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, VOCAB, (16,), generator=gen).tolist()
    prompts = [prefix + torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 14)]
    prompts.append(torch.randint(0, VOCAB, (21,), generator=gen).tolist())
    # 10 blocks of 8 slots for three sequences of up to 46 tokens: preemption is forced;
    # 16-token steps chunk the prompts (the Triton kernels take block_size 8 and up)
    llm = LLM(
        str(path),
        dtype="float32",
        attention_impl="triton",
        block_size=8,
        num_kv_blocks=10,
        max_num_batched_tokens=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)  # fills the prefix blocks
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert stats.chunked_prefills > 0
    assert stats.prefix_hit_tokens >= 16
    assert stats.preemptions_recompute > 0
    for prompt, output in zip(prompts, first + rest, strict=True):
        assert len(output.token_ids) == NEW_TOKENS
        check_greedy(hf, prompt, output.token_ids)


def test_triton_on_the_cpu_needs_the_interpreter(tiny_models, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(str(tiny_models["llama3"]), dtype="float32", attention_impl="triton")


def test_triton_rejects_a_block_size_at_start(tiny_models):
    with pytest.raises(ValueError, match="block_size 4 is not supported"):
        LLM(str(tiny_models["llama3_hd64"]), dtype="float32", attention_impl="triton", block_size=4)


def test_attention_impl_is_validated():
    from pagecli.config import EngineConfig

    with pytest.raises(ValueError, match="attention_impl must be one of"):
        EngineConfig(attention_impl="cuda")


def test_qwen35_through_triton_kernels_matches_transformers(tmp_path, monkeypatch):
    """Qwen3.5 with attention_impl="triton": the gated attention layers through the Triton
    attention kernels, the Gated DeltaNet recurrence through its Triton kernel (decodes and
    prefill chunks of a step in one launch), over chunked prefills and a second turn that
    resumes from a state snapshot; greedy parity with transformers."""
    from transformers import AutoModelForCausalLM

    from pagecli_kernels import gated_delta
    from tests.tiny_models import build_tiny_models, family_configs

    launches = count_calls(monkeypatch, gated_delta, "gated_delta_recurrence")
    config = family_configs()["qwen3_5"]
    config.head_dim = 64  # the Triton attention kernels' head sizes start at 64
    path = build_tiny_models(tmp_path, {"qwen3_5_hd64": config})["qwen3_5_hd64"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (40, 13)]
    llm = LLM(
        str(path),
        dtype="float32",
        attention_impl="triton",
        block_size=8,
        max_num_batched_tokens=16,
        state_snapshot_stride=1,
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.stats().chunked_prefills > 0
    assert launches[0] > 0  # the recurrence took the Triton kernel
    for prompt, output in zip(prompts, outputs, strict=True):
        check_greedy(hf, prompt, output.token_ids)
    second = prompts[0] + outputs[0].token_ids + [5, 6, 7]
    (warm,) = llm.generate([{"prompt_token_ids": second}], params)
    assert warm.num_cached_tokens > 0  # resumed from a snapshot of turn one's state
    llm.engine.check_invariants()
    check_greedy(hf, second, warm.token_ids)


def test_moe_through_triton_kernels_matches_transformers(tmp_path, monkeypatch):
    """Qwen3-MoE with attention_impl="triton": the routed experts of every layer through the
    grouped Triton launches (pagecli_kernels/fused_moe.py) over the experts' stacked weights,
    beside the Triton attention, over chunked prefills; greedy parity with transformers."""
    from transformers import AutoModelForCausalLM

    from pagecli_kernels import fused_moe
    from tests.tiny_models import build_tiny_models, moe_configs

    launches = count_calls(monkeypatch, fused_moe, "fused_moe")
    config = moe_configs()["qwen3_moe"]
    config.head_dim = 64  # the Triton attention kernels' head sizes start at 64
    path = build_tiny_models(tmp_path, {"qwen3_moe_hd64": config})["qwen3_moe_hd64"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (30, 7)]
    llm = LLM(
        str(path), dtype="float32", attention_impl="triton", block_size=8,
        max_num_batched_tokens=16,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.engine.stats().chunked_prefills > 0
    assert launches[0] > 0  # the experts took the Triton kernels
    moe = llm.engine.runner.model.layers[0].mlp
    assert moe.stacked() is not None
    for prompt, output in zip(prompts, outputs, strict=True):
        check_greedy(hf, prompt, output.token_ids)
