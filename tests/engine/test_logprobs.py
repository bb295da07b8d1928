"""Log-probabilities from the engine equal transformers' log-softmax on the same weights, and
ride along with every sample, through chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.oracle import reference_logits
from tests.tiny_models import VOCAB

TOP = 3


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["llama3"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (5 + 23 * i,), generator=gen).tolist() for i in range(n)]


def _check(hf, prompt: list[int], token_ids: list[int], logprobs) -> None:
    assert len(logprobs) == len(token_ids)
    ref = torch.log_softmax(reference_logits(hf, prompt, token_ids), dim=-1)  # [N, V]
    for step, (token, entry, row) in enumerate(zip(token_ids, logprobs, ref)):
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < 1e-4, step
        values, ids = row.topk(TOP)
        assert [t for t, _ in entry.top] == ids.tolist(), step
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("num_kv_blocks", [None, 60])
def test_greedy_logprobs_equal_transformers(tiny, num_kv_blocks):
    path, hf = tiny
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=48,
        num_kv_blocks=num_kv_blocks,
    )
    prompts = _prompts(8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.engine.stats()
    assert stats.chunked_prefills > 0
    if num_kv_blocks is not None:
        assert stats.preemptions_recompute > 0
    for prompt, out in zip(prompts, outputs):
        _check(hf, prompt, out.token_ids, out.outputs[0].logprobs)


def test_every_sample_has_its_own_logprobs(tiny):
    path, hf = tiny
    llm = LLM(str(path), dtype="float32", block_size=4)
    prompt = _prompts(1)[0]
    params = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True, logprobs=TOP
    )
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert len(out.outputs) == 3
    for sample in out.outputs:
        _check(hf, prompt, sample.token_ids, sample.logprobs)


def test_no_logprobs_unless_asked(tiny):
    path, _ = tiny
    llm = LLM(str(path), dtype="float32", block_size=4)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3))[0]
    assert out.outputs[0].logprobs is None
    zero = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, logprobs=0)
    )[0]
    assert [e.top for e in zero.outputs[0].logprobs] == [[], [], []]


def test_logprobs_bounds():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
