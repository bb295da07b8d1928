"""Speculative decoding with a draft model (engine/spec_decode/draft.py): the tokens decoding
without it gives, through batches, chunked prefills, prefix hits, preemption (recompute and
swap), stops inside a run of drafts and seeded sampling with forks.

Most tests use the default model's own file as its draft: its guesses are then right nearly
always, but only while the draft's cache holds the K/V of the sequence's tokens at the right
block ids (caught up after the prompt, rolled back after a rejection, reset by a recompute
preemption, swapped beside the target's blocks, copied with them on a fork): a draft cache
gone wrong shows as a low acceptance rate, which the tests check. A random draft of other
shapes checks the rejections."""

from __future__ import annotations

import pytest

from pagecli import LLM, SamplingParams
from pagecli.errors import ModelLoadError
from pagecli.loader.resolve import default_gguf_path
from tests.engine.test_spec_decode import PROMPTS, same, tight_engine
from tests.sizes import FULL, size

# `make test` runs one of each pair; PAGECLI_FULL_TESTS=1 runs both
full_only = pytest.mark.skipif(not FULL, reason="PAGECLI_FULL_TESTS=1 runs it")

SELF_DRAFT = {"model": str(default_gguf_path()), "num_speculative_tokens": 4}


def run(prompts, params, spec: dict | None, **engine):
    llm = LLM(None, speculative_config=spec, **engine)
    outputs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert stats.blocks_in_use == 0
    return outputs, stats


@pytest.mark.parametrize("max_num_seqs", [1, pytest.param(8, marks=full_only)])
def test_greedy_identity_with_its_own_weights_as_draft(max_num_seqs):
    params = SamplingParams(temperature=0, max_tokens=size(32, 128))
    off, _ = run(PROMPTS, params, None, max_num_seqs=max_num_seqs)
    on, stats = run(PROMPTS, params, SELF_DRAFT, max_num_seqs=max_num_seqs)
    same(off, on)
    assert stats.spec_drafts > 0
    assert stats.spec_acceptance_rate > 0.9, stats.spec_acceptance_rate
    assert stats.num_steps < sum(len(o.token_ids) for o in on)


@pytest.mark.parametrize("mode", [pytest.param("recompute", marks=full_only), "swap"])
def test_identity_through_chunks_prefix_hits_and_preemption(mode):
    """A small cache (preemption), a small token budget (chunked prefills and catch-ups
    of the draft in chunks), a prompt twice (prefix hits)."""
    prompts = PROMPTS[:3] + PROMPTS[:1]
    params = SamplingParams(temperature=0, max_tokens=size(40, 96), logprobs=5)
    engine = tight_engine(mode)
    off, _ = run(prompts, params, None, **engine)
    on, stats = run(prompts, params, SELF_DRAFT, **engine)
    same(off, on)
    assert stats.spec_acceptance_rate > 0.8, stats.spec_acceptance_rate
    assert stats.chunked_prefills > 0 and stats.prefix_hit_tokens > 0
    assert stats.preemptions_swap > 0 if mode == "swap" else stats.preemptions_recompute > 0


def test_stops_eos_and_max_tokens_inside_drafts():
    prompt = PROMPTS[1]
    full, _ = run([prompt], SamplingParams(temperature=0, max_tokens=64), None)
    ids = full[0].token_ids
    cases = [
        SamplingParams(temperature=0, max_tokens=64, stop=["x > 10"]),
        SamplingParams(temperature=0, max_tokens=23),
        SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[ids[12]]),
        SamplingParams(temperature=0, max_tokens=200),  # to EOS
    ]
    for params in cases[: size(1, 4)]:
        off, _ = run([prompt], params, None)
        on, stats = run([prompt], params, SELF_DRAFT)
        same(off, on)
        assert stats.spec_accepted_tokens > 0


def test_seeded_sampling_identity_with_forks():
    """n = 3 forks after the prefill: each sample's draft catches up on the shared prompt
    blocks; sampling draws once per emitted token, in order."""
    params = SamplingParams(
        n=3, temperature=0.8, top_p=0.9, presence_penalty=0.3, seed=11, max_tokens=size(24, 96)
    )
    prompts = PROMPTS[: size(1, 3)]
    off, _ = run(prompts, params, None)
    on, stats = run(prompts, params, SELF_DRAFT)
    same(off, on)
    assert stats.spec_accepted_tokens > 0


def test_a_random_draft_of_other_shapes(random_draft):
    """Its drafts are mostly wrong: every step rolls back, the output stays the target's."""
    params = SamplingParams(temperature=0, max_tokens=size(24, 96))
    spec = {"model": str(random_draft), "num_speculative_tokens": 3}
    prompts = PROMPTS[: size(3, 5)]
    off, _ = run(prompts, params, None, max_num_seqs=4)
    on, stats = run(prompts, params, spec, max_num_seqs=4)
    same(off, on)
    assert stats.spec_draft_tokens > 0
    assert stats.spec_acceptance_rate < 0.5


def test_both_caches_share_the_budget_and_the_block_ids():
    """The model as its own draft: each block id holds its pages in both caches, so the
    budget gives half the block ids."""
    llm = LLM(None, kv_cache_memory=0.05, speculative_config=SELF_DRAFT)
    target, draft = llm.engine.runner, llm.engine.proposer.runner
    assert draft.num_blocks == target.num_blocks
    assert draft.block_bytes == target.block_bytes == llm.engine.proposer.block_bytes
    budget = 0.05 * 2**30
    assert target.num_blocks == int(budget // (2 * target.block_bytes))
    alone = LLM(None, kv_cache_memory=0.05).engine.runner
    assert alone.num_blocks == int(budget // target.block_bytes) >= 2 * target.num_blocks


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    """The default model's weights with a tokenizer whose ids 3-8 are other tokens."""
    from tests.tool_tokenizer import tool_model_dir

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    draft = tool_model_dir(tmp_path / "other", template)
    with pytest.raises(ModelLoadError, match="tokenizer is not the target's"):
        LLM(None, speculative_config={"model": str(draft)})


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_draft_cache_holds_each_sequences_tokens_at_its_block_ids(mode):
    """The invariant the acceptance rates above rest on, checked after every step: with the
    model as its own draft, the first layer's keys (a function of a token and its position
    only) in the draft's cache equal the target's at every position the draft counts as
    computed, in the sequence's blocks, whatever preemption, swaps and rollbacks moved."""
    import torch

    llm = LLM(
        None,
        speculative_config=SELF_DRAFT,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=32,
        preemption_mode=mode,
        swap_space=0.05 if mode == "swap" else 0.0,
    )
    engine = llm.engine
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=size(40, 64))
    for i, prompt in enumerate(PROMPTS[:4]):
        ids = tok.encode(tok.apply_chat_template(prompt, add_generation_prompt=True))
        engine.add_request(str(i), ids, params)
    target, draft = engine.runner, engine.proposer.runner
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.num_draft_computed
            if not n:
                continue
            pos = torch.arange(n)
            blocks = torch.tensor(seq.block_tables[0])[pos // 4]
            want = target.kv_cache[0, 0, blocks, pos % 4]  # [n, heads, dim]
            got = draft.kv_cache[0, 0, blocks, pos % 4]
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
            checked += n
    stats = engine.stats()
    assert checked > 0 and stats.spec_accepted_tokens > 0
    assert stats.preemptions_swap > 0 if mode == "swap" else stats.preemptions_recompute > 0
