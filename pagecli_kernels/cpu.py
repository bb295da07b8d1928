"""Fast versions of the paged ops, the ones the engine runs on the CPU.

Decode attention and prefill chunks run the native C kernel of pagecli_kernels/native.py,
which reads the cache in place, for float32, bfloat16 and float16 caches. Only where the
kernel cannot be built (no C compiler, PAGECLI_NATIVE_KERNELS=0) does each call gather the
context K/V through the block tables with one index_select per cache and run torch's
scaled_dot_product_attention (grouped-query heads via enable_gqa). Context slots past a
sequence's length are redirected to the sequence's first slot, which it owns, so a
masked-out slot can never bring NaN or garbage into the result (0 * NaN would).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagecli_kernels import fused_cpu, native
from pagecli_kernels._checks import check_attention, check_lengths_host, check_store_kv


def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks * block_size, num_kv_heads, head_dim], a view when possible."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    if cache.stride(0) == block_size * cache.stride(1):
        return cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    return cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i] / value[i] into cache slot slot_mapping[i]; negative slots are skipped."""
    cache = check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    if slot_mapping.numel() == 0:
        return
    if fused_cpu.store_kv(key, value, k_cache, v_cache, slot_mapping):
        return  # one native row copy per token
    num_slots = cache.num_blocks * cache.block_size
    if int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping has a slot past the cache's {num_slots} slots")
    if int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_ids = slot_mapping // cache.block_size
    offsets = slot_mapping % cache.block_size
    # Advanced indexing on the first two dims writes in place whatever the cache's strides.
    k_cache[block_ids, offsets] = key
    v_cache[block_ids, offsets] = value


def _padded_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of every context position, padded to max_len, and the mask of real positions.

    Returns slots [num_seqs, max_len] int64 and valid [num_seqs, max_len] bool. Padding
    positions hold the sequence's first slot (owned and finite; the mask hides it).
    """
    pos = torch.arange(max_len, device=block_tables.device)  # [max_len]
    block_ids = block_tables[:, pos // block_size].long()  # [num_seqs, max_len]
    slots = block_ids * block_size + pos % block_size
    valid = pos < seq_lens.unsqueeze(1)  # [num_seqs, max_len]
    return torch.where(valid, slots, slots[:, :1]), valid


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Decode attention for checked inputs; query [num_seqs, num_heads, D]."""
    if native.supports(query, k_cache, v_cache):
        num_seqs = query.shape[0]
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)  # one token each
        return native.paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_seq_len=max_len,
        )
    num_seqs = query.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    slots, valid = _padded_slots(block_tables, seq_lens, max_len, block_size)
    index = slots.view(-1)
    # [num_seqs, num_kv_heads, max_len, D]
    keys = _flat_slots(k_cache).index_select(0, index).view(num_seqs, max_len, num_kv_heads, -1)
    values = _flat_slots(v_cache).index_select(0, index).view(num_seqs, max_len, num_kv_heads, -1)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    mask = valid[:, None, None, :]  # [num_seqs, 1, 1, max_len]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
    )  # [num_seqs, num_heads, 1, D]
    return out.squeeze(2)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over all seq_lens[i] cached tokens."""
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens)
    lens, _ = check_lengths_host(query, block_tables, seq_lens, cache.block_size)
    if not lens:
        return torch.empty_like(query)
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, max(lens), scale)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens, the last of its seq_lens, over its cache.

    The native kernel takes the whole batch in one call. On the torch path, sequences with a
    single new token run together as one decode batch; the others run one SDPA call each,
    over a context gathered for all of them at once.
    """
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    lens, query_lens = check_lengths_host(
        query, block_tables, seq_lens, cache.block_size, query_start_loc
    )
    if native.supports(query, k_cache, v_cache):
        if not lens:
            return torch.empty_like(query)
        return native.paged_attention(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_seq_len=max(lens),
        )
    out = torch.empty_like(query)  # [num_tokens, num_heads, D]
    starts = query_start_loc.tolist()
    single = [i for i, n in enumerate(query_lens) if n == 1]
    multi = [i for i, n in enumerate(query_lens) if n > 1]

    if single:
        seq_ids = torch.tensor(single, device=query.device)
        tokens = torch.tensor([starts[i] for i in single], device=query.device)
        out[tokens] = _decode(
            query[tokens],
            k_cache,
            v_cache,
            block_tables[seq_ids],
            seq_lens[seq_ids],
            max(lens[i] for i in single),
            scale,
        )
    if not multi:
        return out

    # One gather for the contexts of all multi-token sequences, back to back.
    multi_lens = torch.tensor([lens[i] for i in multi], device=query.device)  # [num_multi]
    ctx_starts = torch.cumsum(multi_lens, 0) - multi_lens
    owner = torch.repeat_interleave(torch.arange(len(multi), device=query.device), multi_lens)
    pos = torch.arange(int(multi_lens.sum()), device=query.device) - ctx_starts[owner]
    seq_ids = torch.tensor(multi, device=query.device)[owner]  # [total_ctx]
    slots = block_tables[seq_ids, pos // cache.block_size].long() * cache.block_size
    slots += pos % cache.block_size
    keys = _flat_slots(k_cache).index_select(0, slots)  # [total_ctx, num_kv_heads, D]
    values = _flat_slots(v_cache).index_select(0, slots)

    ctx_start = 0
    for i in multi:
        seq_len, query_len, start = lens[i], query_lens[i], starts[i]
        k = keys[ctx_start : ctx_start + seq_len].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = values[ctx_start : ctx_start + seq_len].transpose(0, 1).unsqueeze(0)
        ctx_start += seq_len
        q = query[start : start + query_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if query_len == seq_len:
            mask, causal = None, True
        else:
            # New token j sits at position seq_len - query_len + j: bottom-right alignment.
            q_pos = torch.arange(query_len, device=query.device) + (seq_len - query_len)
            k_pos = torch.arange(seq_len, device=query.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False  # [n, L]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )  # [1, H, n, D]
        out[start : start + query_len] = o.squeeze(0).transpose(0, 1)
    return out
