"""Prompt text that cannot fit is refused from a bounded prefix: the work done grows with the
limit, not with the text (a 50 MB line used to cost 106 s and 18 GB spent on 25 million
tokens)."""

from __future__ import annotations

import time

import pytest

from pagecli.tokenizer import PromptTooLongError, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer(default_model_dir, "default")


@pytest.fixture
def counted(tokenizer, monkeypatch):
    """The characters handed to the underlying tokenizer, call by call."""
    seen: list[int] = []
    encode = tokenizer.hf.encode

    def counting(text, **kw):
        seen.append(len(text))
        return encode(text, **kw)

    monkeypatch.setattr(tokenizer.hf, "encode", counting)
    return seen


@pytest.mark.parametrize("unit", ["a ", "#" * 80, "日本語 "], ids=["short", "long", "cjk"])
def test_text_that_cannot_fit_costs_the_limit_not_the_text(tokenizer, counted, unit):
    limit = 500
    text = unit * (50 * 2**20 // len(unit.encode()))  # 50 MB
    start = time.perf_counter()
    with pytest.raises(PromptTooLongError) as error:
        tokenizer.encode(text, max_tokens=limit)
    assert time.perf_counter() - start < 2
    assert error.value.num_chars == len(text) and error.value.max_tokens == limit
    # Prefixes only: in all, a small multiple of what `limit` tokens of this text hold.
    assert sum(counted) <= 4 * (limit + 16) * max(4, len(unit)), counted


@pytest.mark.parametrize("num_units", [10, 400, 2000])
def test_text_that_fits_is_tokenized_as_before(tokenizer, num_units):
    text = "The sea, the waves. " * num_units
    expected = tokenizer.hf.encode(text, add_special_tokens=True)
    limit = len(expected) + 1
    assert tokenizer.encode(text, max_tokens=limit) == expected
    assert tokenizer.encode(text) == expected
    with pytest.raises(PromptTooLongError):
        tokenizer.encode(text, max_tokens=len(expected) // 8 - 16)


def test_llm_turns_it_into_a_request_error_naming_the_limit(default_model_dir):
    """The same bound serves generate (LLM.generate / encode_prompt) and chat sessions."""
    from pagecli import LLM, SamplingParams
    from pagecli.engine.llm_engine import RequestError

    llm = LLM(None, num_kv_blocks=64, block_size=16, max_model_len=512)
    huge = "a " * (10 * 2**20)
    out = llm.generate([huge, "Hi"], SamplingParams(max_tokens=2))
    assert out[0].finish_reason == "error" and "max_model_len (512 tokens)" in out[0].error
    assert out[1].error is None
    with pytest.raises(RequestError, match="does not fit"):
        llm.encode_prompt([{"role": "user", "content": huge}])
    session = llm.chat_session()
    session.send("Hi", SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(RequestError, match="tokens left in max_model_len"):
        session.send(huge, SamplingParams(max_tokens=2))
    assert len(session.messages) == 2  # the refused turn is not recorded
