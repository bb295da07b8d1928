"""Fixtures the engine tests share."""

from __future__ import annotations

import shutil

import pytest

from pagecli.loader.resolve import float_checkpoint, resolve_model


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """A 2-layer random Llama with the default model's tokenizer: other layer count, heads
    and head size, so other pages over the same block ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    source = float_checkpoint(resolve_model(None))
    path = tmp_path_factory.mktemp("draft") / "random-draft"
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    torch.manual_seed(5)
    LlamaForCausalLM(config).save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, path / name)
    return path
