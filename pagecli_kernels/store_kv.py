"""Triton kernel writing new tokens' K/V into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecli_kernels._checks import check_store_kv
from pagecli_kernels._triton_utils import check_triton_support


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: copy its [NUM_KV_HEADS, HEAD_DIM] key and value rows.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    # A negative slot means "do not store": no head is in range. (Folding the scalar test in
    # with `& (slot >= 0)` gives an int32 mask that Triton's interpreter rejects.)
    num_heads_to_store = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads_to_store) & (dims[None, :] < HEAD_DIM)

    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    k_dst = (
        k_cache_ptr
        + block_id * stride_k_cache_block
        + offset * stride_k_cache_slot
        + heads[:, None] * stride_k_cache_head
        + dims[None, :]
    )
    v_dst = (
        v_cache_ptr
        + block_id * stride_v_cache_block
        + offset * stride_v_cache_slot
        + heads[:, None] * stride_v_cache_head
        + dims[None, :]
    )
    tl.store(k_dst, key, mask=mask)
    tl.store(v_dst, value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i] / value[i] into cache slot slot_mapping[i]; negative slots are skipped."""
    cache = check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    check_triton_support(cache.head_dim, cache.block_size, key, value, k_cache, v_cache)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=cache.num_kv_heads,
        HEAD_DIM=cache.head_dim,
        BLOCK_HEADS=triton.next_power_of_2(cache.num_kv_heads),
        BLOCK_D=triton.next_power_of_2(cache.head_dim),
        BLOCK_SIZE=cache.block_size,
        num_warps=4 if cache.num_kv_heads * cache.head_dim >= 1024 else 1,
    )
