"""Prefix sharing: identical outputs with caching on and off (under evictions, preemption and
swapping), chat sessions sharing a system prompt, multi-turn reuse, and n > 1 samples holding
their prompt once."""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.tiny_models import VOCAB

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def shared_prefix_batch(num_records=16, prefix_len=120, seed=3):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, VOCAB, (prefix_len,), generator=gen).tolist()
    return [
        {"prompt_token_ids": prefix + torch.randint(0, VOCAB, (5 + 3 * i,), generator=gen).tolist()}
        for i in range(num_records)
    ]


def run(path, prompts, **config):
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=96, **config)
    outputs = llm.generate(prompts, GREEDY)
    llm.engine.check_invariants()
    return [o.token_ids for o in outputs], llm.engine.stats()


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_same_output_with_caching_on_and_off(tiny_models, arch):
    prompts = shared_prefix_batch()
    path = tiny_models[arch]
    off, off_stats = run(path, prompts, enable_prefix_caching=False, num_kv_blocks=2000)
    on, on_stats = run(path, prompts, num_kv_blocks=2000)
    assert on == off
    assert off_stats.prefix_hit_tokens == 0
    # Records admitted while the first one is still prefilling its prefix in chunks find only
    # part of it; the rest find all 120 tokens.
    assert on_stats.prefix_hit_tokens >= 13 * 120
    # A cache of 80 blocks (320 slots) for 16 sequences of ~170 tokens: evictions and
    # preemptions are forced, and outputs must not change.
    small, small_stats = run(path, prompts, num_kv_blocks=80)
    assert small == off
    assert small_stats.evictions > 0 and small_stats.preemptions_recompute > 0
    swap, swap_stats = run(path, prompts, num_kv_blocks=80, preemption_mode="swap", swap_space=0.01)
    assert swap == off
    assert swap_stats.preemptions_swap > 0


def test_swap_pool_full_falls_back_to_recompute(tiny_models):
    prompts = shared_prefix_batch()
    path = tiny_models["qwen2"]
    reference, _ = run(path, prompts, enable_prefix_caching=False, num_kv_blocks=2000)
    # A swap pool of a few blocks cannot take a whole sequence: recompute instead.
    out, stats = run(path, prompts, num_kv_blocks=80, preemption_mode="swap", swap_space=2e-6)
    assert out == reference
    assert stats.preemptions_recompute > 0


# ---- the default model ---------------------------------------------------------------------

SYSTEM = (
    "You are a meticulous assistant for a public library. Answer briefly and cite the shelf. "
    + " ".join(
        f"Rule {i}: books in section {i % 7} must be returned within {i % 5 + 7} days."
        for i in range(1, 60)
    )
)


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", block_size=16, num_kv_blocks=1024)


def test_eight_sessions_share_the_system_prompt(llm):
    tok = llm.tokenizer
    system_ids = tok.encode_chat([{"role": "system", "content": SYSTEM}], False)
    assert 950 <= len(system_ids) <= 1300, len(system_ids)
    full_blocks = len(system_ids) // 16
    sessions = [llm.chat_session(system=SYSTEM, name=f"s{i}") for i in range(8)]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # Session 0 prefills the system prompt; the other seven join once it is decoding.
    engine.add_request("s0", sessions[0].prompt_ids("Where are atlases?"), params)
    while not any(s.num_output_tokens for s in engine.scheduler.running):
        engine.step()
    for i in range(1, 8):
        engine.add_request(f"s{i}", sessions[i].prompt_ids(f"Question {i}: opening hours?"), params)
    engine.step()
    running = engine.scheduler.running
    assert len(running) == 8
    table = running[0].block_table
    for block_id in table[:full_blocks]:
        assert engine.block_manager.blocks[block_id].ref_count == 8
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs["s0"].num_cached_tokens == 0
    for i in range(1, 8):
        assert outputs[f"s{i}"].num_cached_tokens >= full_blocks * 16
    engine.check_invariants()


def test_multi_turn_prefills_only_new_tokens(llm):
    session = llm.chat_session(system="You are terse.", name="turns")
    params = SamplingParams(temperature=0, max_tokens=12)
    kept: list[int] = []
    for turn, question in enumerate(
        ["Name a color.", "Another one?", "And a fruit?", "Which is sweeter?", "Thanks!"]
    ):
        prompt = session.prompt_ids(question)
        out = session.send(question, params)
        assert out.prompt_token_ids == prompt
        if turn:
            new_tokens = len(prompt) - len(kept)
            assert prompt[: len(kept)] == kept  # the previous turn's ids, unchanged
            assert len(prompt) - out.num_cached_tokens <= new_tokens + 16
        kept = session.token_ids
    assert not session.warnings
    assert len(session.messages) == 11


def test_template_mismatch_warns(llm):
    session = llm.chat_session(name="edited")
    session.send("Hi", SamplingParams(temperature=0, max_tokens=6))
    session.messages[-1]["content"] = "Something the model never said."
    with pytest.warns(UserWarning, match="turn 1"):
        session.prompt_ids("Go on")


def test_n_samples_hold_the_prompt_once(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode(SYSTEM)[:600]  # 37 full blocks and a partial one
    engine.add_request("fan", prompt, SamplingParams(n=8, temperature=1.0, seed=5, max_tokens=8))
    while len(engine.scheduler.running) < 8:
        engine.step()
    bm = engine.block_manager
    tables = [s.block_table for s in engine.scheduler.running]
    prompt_blocks = -(-len(prompt) // 16)
    assert all(t[: prompt_blocks - 1] == tables[0][: prompt_blocks - 1] for t in tables)
    for block_id in tables[0][: prompt_blocks - 1]:
        assert bm.blocks[block_id].ref_count == 8
    used_before = bm.num_used_blocks
    engine.step()  # every sample writes into the shared partial block: copy-on-write
    assert bm.counters.cow_copies >= 7
    assert bm.num_used_blocks <= used_before + 8
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()


def test_records_submitted_together_share_their_system_prompt(llm):
    """A record waits one step for a shared prefix that another record is computing, then
    finds it cached instead of computing it again."""
    system = "You are a helpful assistant who answers in one short sentence. " * 6
    prompts = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}]
        for i in range(8)
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    system_blocks = len(llm.tokenizer.encode_chat(prompts[0][:1], False)) // 16
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= system_blocks * 16 for o in outs[1:])
