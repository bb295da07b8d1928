"""Shared fixtures: the default model, tiny random-weight models, and the transformers oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model in the HF layout, with float32 weights for transformers (cached
    under the user cache dir)."""
    from pagecli.loader.resolve import float_checkpoint, resolve_model

    return float_checkpoint(resolve_model(None))


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Random-weight checkpoints of each supported architecture, built with transformers'
    own config classes and saved as safetensors (no tokenizer: tests pass token ids)."""
    from tests.tiny_models import build_tiny_models

    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def family_models(tmp_path_factory) -> dict[str, Path]:
    """Random-weight checkpoints of the families of models/ beyond Llama (Gemma 3, Phi-3/4,
    SmolLM3, OLMo 2, Granite, Mistral and Ministral with real windows)."""
    from tests.tiny_models import build_tiny_models, family_configs

    return build_tiny_models(tmp_path_factory.mktemp("families"), family_configs())


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    """Random-weight checkpoints of the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE,
    Mixtral, OLMoE)."""
    from tests.tiny_models import build_tiny_models, moe_configs

    return build_tiny_models(tmp_path_factory.mktemp("moe"), moe_configs())
