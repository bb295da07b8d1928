"""Greedy parity with transformers for tiny random-weight Llama-3 (llama3 RoPE scaling),
Mistral, Qwen2 (q/k/v bias, tied embeddings) and Qwen3 (q/k norm, MQA) checkpoints."""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.oracle import check_greedy, compare_with_generate
from tests.tiny_models import VOCAB

LENGTHS = [1, 2, 3, 4, 5, 7, 9, 16, 31, 64, 100, 150, 230, 300]
NEW_TOKENS = 32


def random_prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def generate(path, prompts, **engine_config):
    llm = LLM(str(path), dtype="float32", **engine_config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return llm, outputs


@pytest.fixture(scope="module", params=["llama3", "mistral", "qwen2", "qwen3"])
def arch(request, tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models[request.param]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return request.param, path, hf


def test_parity_mixed_batch(arch):
    name, path, hf = arch
    prompts = random_prompts(hash(name) % 1000)
    llm, outputs = generate(path, prompts, block_size=4, max_num_batched_tokens=64)
    assert llm.engine.stats().chunked_prefills > 0
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        check_greedy(hf, prompt, output.token_ids)
    compare_with_generate(hf, prompts[-1], outputs[-1].token_ids)


def test_parity_under_preemption(arch):
    name, path, hf = arch
    prompts = random_prompts(7, [20, 40, 60, 80, 100, 120])
    # 60 blocks of 4 = 240 slots for six sequences of up to 152 tokens.
    llm, outputs = generate(
        path, prompts, block_size=4, num_kv_blocks=60, max_num_batched_tokens=32
    )
    assert llm.engine.stats().preemptions_recompute > 0
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)
