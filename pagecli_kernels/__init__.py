"""Paged-KV-cache ops: store_kv, paged_decode_attention, paged_prefill_attention.

See pagecli_kernels/ops.py for the `impl` choices (Triton, fast CPU path, reference). The ops
are imported on first use (they import torch), so that pagecli_kernels.settings stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]

if TYPE_CHECKING:
    from pagecli_kernels.ops import paged_decode_attention, paged_prefill_attention, store_kv


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'pagecli_kernels' has no attribute {name!r}")
    from pagecli_kernels import ops

    value = getattr(ops, name)
    globals()[name] = value  # found once; later lookups skip this function
    return value
