"""A model's config from its folder: transformers' config object, or, for a folder converted
from a GGUF file, the same values without transformers (loader/model_config.py). Imports no
torch: a bench against a remote server sizes its workload with it."""

from __future__ import annotations

import json
from typing import Any

from pagecli.errors import ModelLoadError
from pagecli.loader.model_config import load_full_config
from pagecli.loader.resolve import ModelSource


def load_hf_config(source: ModelSource) -> Any:
    """The model's config, read from its config.json (for a converted GGUF the same values
    without transformers, as a ModelConfig)."""
    path = source.path / "config.json"
    try:
        json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{source.name}: unreadable config.json ({exc})") from None
    if source.kind == "gguf":
        config = load_full_config(source.path)
        if config is not None:
            return config
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source.path))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{source.name}: cannot read config.json ({first})") from None
    return text_model_config(config)


def text_model_config(config: Any) -> Any:
    """For a multimodal checkpoint whose language model a family runs
    (CausalLM.multimodal_architectures): its text_config, under that family's architecture,
    with the checkpoint's tying of the output projection; any other config as it is."""
    text = getattr(config, "text_config", None)
    if text is None or text is config:
        return config
    from pagecli.models.registry import multimodal_text_model

    found = multimodal_text_model(getattr(config, "architectures", None))
    if found is None:
        return config
    cls, _ = found
    text.architectures = [cls.hf_architectures[0]]
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:
        text.tie_word_embeddings = bool(tied)
    return text
