"""The n-gram proposer's index against a brute-force search (its drafts, and which of them are
ambiguous), and the speculative config."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pagecli.config import EngineConfig, SpeculativeConfig
from pagecli.engine.spec_decode.ngram import NgramIndex


def latest_match(tokens: list[int], min_n: int, max_n: int) -> tuple[int, int] | None:
    """(n, the position after it) of the latest earlier occurrence of the longest suffix (max_n
    down to min_n) that occurred before with a token after it; None where none did."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # an occurrence ending before the end
            if tokens[start : start + n] == suffix:
                return n, start + n
    return None


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The k tokens after latest_match."""
    match = latest_match(tokens, min_n, max_n)
    return tokens[match[1] : match[1] + k] if match else []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    k=st.integers(1, 6),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    cut=st.integers(0, 60),
)
def test_index_equals_brute_force_as_the_sequence_grows(tokens, k, sizes, cut):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(min_n, max_n)
    prefix = tokens[: max(1, min(cut, len(tokens)))]
    assert index.propose(prefix, k) == brute_force(prefix, k, min_n, max_n)
    for end in range(len(prefix) + 1, len(tokens) + 1):  # grown one token at a time
        assert index.propose(tokens[:end], k) == brute_force(tokens[:end], k, min_n, max_n)


def brute_force_ambiguous(tokens: list[int], k: int, min_n: int, max_n: int) -> list[bool]:
    """For each draft of brute_force's, whether the tokens it was copied after (the match
    and the drafts before it, max_n at most) have been followed by two different tokens."""
    match = latest_match(tokens, min_n, max_n)
    if match is None:
        return []
    (n, start), length, found = match, len(tokens), []
    for j in range(len(tokens[start : start + k])):
        size = min(max_n, n + j)
        gram = tokens[start + j - size : start + j]
        after = {tokens[s + size] for s in range(length - size) if tokens[s : s + size] == gram}
        found.append(len(after) > 1)
    return found


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    k=st.integers(1, 6),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_lookup_marks_the_drafts_copied_after_an_ambiguous_context(tokens, k, sizes):
    """`lookup`'s drafts are `propose`'s, and a draft is ambiguous exactly where the context
    it was copied after went on in two ways somewhere in the sequence."""
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    index = NgramIndex(min_n, max_n)
    for end in range(1, len(tokens) + 1):  # grown one token at a time
        found = index.lookup(tokens[:end], k)
        drafts = brute_force(tokens[:end], k, min_n, max_n)
        if found is None:
            assert drafts == []
            continue
        assert found.drafts == drafts
        assert found.ambiguous == brute_force_ambiguous(tokens[:end], k, min_n, max_n)


def test_longest_match_wins_and_the_latest_occurrence():
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 2, 3, 5, 1, 2, 3]
    # [1, 2, 3] occurred at 1..3, followed by 9; [2, 3] more recently at 5..6, followed by 5
    assert index.propose(tokens, 3) == [9, 2, 3]
    assert NgramIndex(1, 2).propose(tokens, 3) == [5, 1, 2]
    assert NgramIndex(1, 3).propose([4, 5, 6], 2) == []


def test_config_parses_vllm_keys_and_refuses_the_rest():
    spec = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        3,
        2,
        4,
    )
    assert SpeculativeConfig.parse({"prompt_lookup_max": 1}).prompt_lookup_min == 1
    # a draft model: vLLM's method name, inferred from the "model" key
    draft = SpeculativeConfig.parse('{"model": "draft.gguf", "num_speculative_tokens": 3}')
    assert (draft.method, draft.model, draft.num_speculative_tokens) == (
        "draft_model",
        "draft.gguf",
        3,
    )
    assert EngineConfig(speculative_config='{"method": "ngram"}').speculative_config == (
        SpeculativeConfig()
    )
    for bad, word in [
        ('{"method": "ngram", "k": 3}', "unknown key 'k'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "eagle"}', "method"),
        ('{"method": "draft_model"}', "needs a draft"),
        ('{"method": "ngram", "model": "draft.gguf"}', "takes method draft_model"),
        ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_max"),
        ("[1, 2]", "JSON object"),
        ("{not json", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.parse(bad)
