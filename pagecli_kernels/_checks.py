"""Shape, dtype and device checks shared by every implementation of the paged ops.

Every check raises ValueError naming the bad value and what was expected. None of them reads
tensor contents, so they never force a device sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class CacheShape(NamedTuple):
    """The four sizes of a paged K/V cache `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_dtype(name: str, tensor: torch.Tensor) -> None:
    """Reject dtypes other than float32, float16 and bfloat16."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise ValueError(f"{name} has dtype {tensor.dtype}; supported: {allowed}")


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> CacheShape:
    """Check the K and V caches agree with each other and return their sizes."""
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    check_dtype("k_cache", k_cache)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    shape = CacheShape(*k_cache.shape)
    if shape.block_size < 1 or shape.num_kv_heads < 1 or shape.head_dim < 1:
        raise ValueError(f"empty cache dimension in shape {tuple(k_cache.shape)}")
    return shape


def _check_int_tensor(
    name: str, tensor: torch.Tensor, dtype: torch.dtype, dim: int, device: torch.device
) -> None:
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the cache on {device}")


def check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> CacheShape:
    """Check the arguments of store_kv; return the cache sizes."""
    cache = check_cache(k_cache, v_cache)
    expected = ("num_tokens", cache.num_kv_heads, cache.head_dim)
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected[1:]:
            raise ValueError(
                f"{name} must be [num_tokens, {cache.num_kv_heads}, {cache.head_dim}] "
                f"to match the cache, got shape {tuple(tensor.shape)}"
            )
        if tensor.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {tensor.dtype} != cache dtype {k_cache.dtype}")
        if tensor.device != k_cache.device:
            raise ValueError(f"{name} is on {tensor.device}, the cache on {k_cache.device}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    _check_int_tensor("slot_mapping", slot_mapping, torch.int64, 1, k_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    return cache


def check_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
) -> CacheShape:
    """Check the arguments of the paged attention ops; return the cache sizes.

    With `query_start_loc` None the call is a decode: one query token per sequence.
    """
    cache = check_cache(k_cache, v_cache)
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}"
        )
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != cache dtype {k_cache.dtype}")
    if query.device != k_cache.device:
        raise ValueError(f"query is on {query.device}, the cache on {k_cache.device}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    if head_dim != cache.head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache.head_dim}")
    if num_heads < 1 or num_heads % cache.num_kv_heads != 0:
        raise ValueError(
            f"num_heads {num_heads} must be a positive multiple of num_kv_heads "
            f"{cache.num_kv_heads}"
        )
    _check_int_tensor("block_tables", block_tables, torch.int32, 2, k_cache.device)
    _check_int_tensor("seq_lens", seq_lens, torch.int32, 1, k_cache.device)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if query_start_loc is None:
        if query.shape[0] != num_seqs:
            raise ValueError(
                f"decode query has {query.shape[0]} tokens for {num_seqs} sequences; "
                "expected one token per sequence"
            )
    else:
        _check_int_tensor("query_start_loc", query_start_loc, torch.int32, 1, k_cache.device)
        if query_start_loc.shape[0] != num_seqs + 1:
            raise ValueError(
                f"query_start_loc has {query_start_loc.shape[0]} entries; expected "
                f"num_seqs + 1 = {num_seqs + 1}"
            )
    return cache


def check_lengths_host(
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    query_start_loc: torch.Tensor | None = None,
) -> tuple[list[int], list[int]]:
    """Check the length tensors' values (reads them: host tensors only).

    Returns (seq_lens, query_lens) as Python lists.
    """
    lens = seq_lens.tolist()
    capacity = block_tables.shape[1] * block_size
    for i, seq_len in enumerate(lens):
        if not 1 <= seq_len <= capacity:
            raise ValueError(
                f"seq_lens[{i}] = {seq_len}; must be in [1, {capacity}] "
                f"(max_blocks_per_seq {block_tables.shape[1]} x block_size {block_size})"
            )
    if query_start_loc is None:
        return lens, [1] * len(lens)
    starts = query_start_loc.tolist()
    if starts[0] != 0 or starts[-1] != query.shape[0]:
        raise ValueError(
            f"query_start_loc must run from 0 to num_tokens {query.shape[0]}, "
            f"got {starts[0]}..{starts[-1]}"
        )
    query_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
    for i, (query_len, seq_len) in enumerate(zip(query_lens, lens, strict=True)):
        if not 1 <= query_len <= seq_len:
            raise ValueError(
                f"sequence {i} has {query_len} new tokens and seq_len {seq_len}; "
                "need 1 <= new tokens <= seq_len"
            )
    return lens, query_lens


def check_window_sinks(
    window: int | None, sinks: torch.Tensor | None, num_heads: int, device: torch.device
) -> None:
    """Check the sliding window and attention sinks of an attention call.

    `window`: the most recent positions a query attends to, itself included (transformers'
    `sliding_window`); None: every earlier position. `sinks`: [num_heads] float, one logit
    per query head that joins each softmax's denominator (gpt-oss); None: no sinks.
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window must be an int or None, got {window!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    if sinks is None:
        return
    if sinks.dim() != 1 or sinks.shape[0] != num_heads or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a float tensor of [num_heads] = [{num_heads}], got {sinks.dtype} "
            f"of shape {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}, the cache on {device}")
