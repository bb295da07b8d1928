"""pagecli: run open-weight LLMs on a paged KV cache with continuous batching.

The public names are imported on first use, so `pagecli --help` and friends start without
loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]

_WHERE = {
    "LLM": "pagecli.llm",
    "EngineConfig": "pagecli.config",
    "SamplingParams": "pagecli.sampling_params",
    "CompletionOutput": "pagecli.outputs",
    "RequestOutput": "pagecli.outputs",
}

if TYPE_CHECKING:
    from pagecli.config import EngineConfig
    from pagecli.llm import LLM
    from pagecli.outputs import CompletionOutput, RequestOutput
    from pagecli.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pagecli' has no attribute {name!r}")
