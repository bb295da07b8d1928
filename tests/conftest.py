"""Shared fixtures: the default model, tiny random-weight models, and the transformers oracle."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _pin_worker() -> None:
    """Under pytest-xdist (`make test` runs two workers), each worker runs on its own share
    of the CPUs, and so do the processes it starts: an engine picks its threads from the CPUs
    it may run on (engine/cpu_threads.py), so two workers' OpenMP threads never wait at each
    other's barriers on one core."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return
    share = cpus[int(worker[2:]) :: count]
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))  # tests that call torch without an engine


_pin_worker()


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
