"""Incremental detokenization streams whole characters and adds up to the full decode."""

from __future__ import annotations

import pytest
import torch

from pagecli.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return Tokenizer(default_model_dir, "default")


TEXTS = [
    "Hello world, this is plain text.",
    "naïve café, 日本語のテキスト, emoji 🎉🚀 and Ελληνικά.",
    "  leading spaces\n\nnew lines\tand tabs  ",
    "<|im_start|>special tokens<|im_end|> inside",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_streams(tokenizer):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tokenizer.vocab_size, (40,), generator=gen).tolist()
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.add([t]) for t in ids)
        full = tokenizer.decode(ids)
        # Random bytes may end in an incomplete character, which is held back.
        assert full.startswith(text) and len(full) - len(text) <= 1
