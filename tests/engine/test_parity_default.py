"""Greedy parity with transformers on the default model (SmolLM2-135M-Instruct, float32).

Twenty-four prompts from 1 to 500 tokens, 32 new tokens each, all submitted together: with a
token budget of 256 per step the batch mixes chunked prefills and decodes. The same workload
runs again with a KV cache so small that sequences are preempted, and with prefix caching off.
"""

from __future__ import annotations

import pytest

from pagecli import LLM, SamplingParams
from tests.oracle import check_greedy, compare_with_generate
from tests.sizes import FULL

PROMPT_LENGTHS = [
    1,
    2,
    3,
    5,
    8,
    13,
    15,
    16,
    17,
    31,
    32,
    33,
    50,
    64,
    100,
    127,
    128,
    129,
    200,
    255,
    256,
    300,
    400,
    500,
]
NEW_TOKENS = 32

TEXT = (
    "The history of computing is a story of ideas that took decades to become practical. "
    "Charles Babbage designed engines of brass and iron; Ada Lovelace wrote of machines that "
    "might compose music. A century later, Alan Turing asked what it means to compute at all, "
    "and engineers built machines of relays, then valves, then transistors. Memory was the "
    "hard part: mercury delay lines, magnetic drums, core memory threaded by hand. Each new "
    "kind of memory changed what programs could be written. Operating systems learned to page "
    "memory in fixed-size blocks so that many programs could share one machine, and the same "
    "idea now lets a language model serve many conversations from one pool of attention keys "
    "and values. In the kitchen, meanwhile, bread still needs flour, water, salt and time. "
)


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    ids = tok.encode(TEXT * 8, add_special_tokens=False)
    # Different offsets so prompts do not all share a prefix.
    return [ids[(7 * i) % 97 : (7 * i) % 97 + n] for i, n in enumerate(PROMPT_LENGTHS)]


def run_engine(prompts, **engine_config):
    llm = LLM(None, dtype="float32", **engine_config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return llm, outputs


def assert_parity(hf_model, prompts, outputs):
    notes = []
    for prompt, output in zip(prompts, outputs):
        assert output.finish_reason == "length", output.error
        assert len(output.token_ids) == NEW_TOKENS
        notes += check_greedy(hf_model, prompt, output.token_ids)
    if notes:
        print("near-ties accepted:", *notes, sep="\n  ")


def test_parity_mixed_batch(hf_default_model, prompts):
    llm, outputs = run_engine(prompts, max_num_batched_tokens=256, block_size=16)
    stats = llm.engine.stats()
    assert stats.chunked_prefills > 0, "prompts longer than the budget must be chunked"
    # Decodes and prefill chunks shared steps: more tokens than decode-only steps could hold.
    assert stats.num_steps < NEW_TOKENS + sum(len(p) for p in prompts) // 256 + 10
    assert_parity(hf_default_model, prompts, outputs)
    # And directly against transformers' own generate loop (3 s a prompt on 2 cores): the
    # longest prompts at the CI size, three lengths in full.
    for i in (0, 14, 21) if FULL else (21,):
        compare_with_generate(hf_default_model, prompts[i], outputs[i].token_ids)


def test_parity_under_preemption(hf_default_model, prompts):
    # 70 blocks of 8 tokens = 560 slots: not even two of the long prompts fit together.
    llm, outputs = run_engine(
        prompts[::2] + prompts[-3:], num_kv_blocks=70, block_size=8, max_num_batched_tokens=128
    )
    stats = llm.engine.stats()
    assert stats.preemptions_recompute > 0, "the small cache must force preemption"
    assert stats.chunked_prefills > 0
    assert stats.blocks_in_use == 0
    assert_parity(hf_default_model, prompts[::2] + prompts[-3:], outputs)
