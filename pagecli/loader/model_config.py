"""A model's config without transformers, for folders pagecli converted from a GGUF file.

The conversion writes, beside config.json, every attribute of the transformers config object
it made (`to_json_string(use_diff=False)`: the class defaults included). `ModelConfig` holds
those values as attributes, which is all the engine reads from a config, so a GGUF start does
not import transformers (about a second and 100 MB). Folders of other sources, and RoPE types
other than the default one, for any layer type (their frequencies come from transformers'
RoPE functions, which want transformers' config object), load transformers' config as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

FULL_CONFIG_FILE = "pagecli-config.json"


class ModelConfig(SimpleNamespace):
    """Config values as attributes (`config.hidden_size`), as the transformers config held
    them."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def load_full_config(folder: Path) -> ModelConfig | None:
    """The folder's full config as a `ModelConfig`, or None where transformers' config object
    is needed (no full config file, a RoPE type other than the default)."""
    path = Path(folder) / FULL_CONFIG_FILE
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(values, dict) or values.get("rope_scaling"):
        return None
    rope = values.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        return None
    # one set of parameters, or one per layer type (Gemma 3): every one the default type
    nested = [v for v in rope.values() if isinstance(v, dict)]
    if any(p.get("rope_type", "default") != "default" for p in [rope, *nested]):
        return None
    return ModelConfig(**values)
