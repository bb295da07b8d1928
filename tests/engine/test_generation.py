"""Sampling, stop conditions, n > 1, streaming and request errors on the default model."""

from __future__ import annotations

import pytest

from pagecli import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", block_size=4, num_kv_blocks=512)


CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def test_same_seed_same_text(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    a, b = llm.generate([CHAT, CHAT], p)
    assert a.text == b.text and a.token_ids == b.token_ids
    c = llm.generate(
        CHAT, SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24)
    )[0]
    assert c.token_ids != a.token_ids


def test_n_samples_share_prompt_and_differ(llm):
    p = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16)
    out = llm.generate(CHAT, p)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.text == out.outputs[0].text
    # Seeded samples are reproducible one by one.
    again = llm.generate(CHAT, p)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    llm.engine.check_invariants()
    assert llm.engine.stats().blocks_in_use == 0


def test_greedy_n_gives_identical_samples(llm):
    # Every greedy sample equals the single greedy answer: copy-on-write copies of the shared
    # last prompt block carry the right K/V.
    single = llm.generate(CHAT, SamplingParams(temperature=0, max_tokens=12))[0]
    out = llm.generate(CHAT, SamplingParams(n=3, temperature=0, max_tokens=12))[0]
    assert [o.token_ids for o in out.outputs] == [single.token_ids] * 3
    assert llm.engine.stats().cow_copies >= 2


def test_stop_string_is_cut(llm):
    greedy = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate(CHAT, greedy)[0].text
    word = full.split()[3]
    stop = llm.generate(CHAT, SamplingParams(temperature=0, max_tokens=40, stop=[word]))[0]
    assert stop.finish_reason == "stop" and stop.outputs[0].stop_reason == word
    assert stop.text == full[: full.index(word)]


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate(CHAT, SamplingParams(temperature=0, max_tokens=40))[0]
    target = greedy.token_ids[5]
    out = llm.generate(CHAT, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[target]))[
        0
    ]
    assert out.token_ids[-1] == target and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == target
    short = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_eos_ends_chat_reply(llm):
    out = llm.generate(
        [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=200)
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.scheduler.eos_token_ids
    assert "<|im_end|>" not in out.text


def test_penalties_change_output(llm):
    base = SamplingParams(temperature=0, max_tokens=30)
    plain = llm.generate("one two one two one two", base)[0]
    penal = llm.generate(
        "one two one two one two",
        SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.5, frequency_penalty=1.0),
    )[0]
    assert plain.token_ids != penal.token_ids


def test_streaming_deltas_add_up(llm):
    deltas = []
    final = None
    for output in llm.stream(CHAT, SamplingParams(temperature=0, max_tokens=30)):
        deltas.append(output.delta)
        final = output
    assert final.finished and "".join(deltas) == final.text
    assert final.text == llm.tokenizer.decode(final.token_ids)
    assert len([d for d in deltas if d]) > 5


def test_request_too_long_is_an_error_for_that_request_only(llm):
    # 512 blocks of 4 = 2,048 slots: prompt + max_tokens past that can never run.
    over = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4000))[0]
    assert over.finish_reason == "error" and "exceeds the KV cache (2048 tokens)" in over.error
    fine, too_long = llm.generate(
        ["Hello", {"prompt_token_ids": [1] * 3000}], SamplingParams(max_tokens=4)
    )
    assert fine.finish_reason == "length" and too_long.finish_reason == "error"
