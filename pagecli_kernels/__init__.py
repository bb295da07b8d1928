"""Paged-KV-cache ops: store_kv, paged_decode_attention, paged_prefill_attention.

See pagecli_kernels/ops.py for the `impl` choices (Triton, fast CPU path, reference).
"""

from pagecli_kernels.ops import paged_decode_attention, paged_prefill_attention, store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
