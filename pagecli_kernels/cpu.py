"""Fast versions of the paged ops, the ones the engine runs on the CPU.

Decode attention and prefill chunks run the native C kernel of pagecli_kernels/native.py,
which reads the cache in place, for float32, bfloat16 and float16 caches. Only where the
kernel cannot be built (no C compiler, PAGECLI_NATIVE_KERNELS=0) does each call gather the
context K/V through the block tables with one index_select per cache and run torch's
scaled_dot_product_attention (grouped-query heads via enable_gqa). Context slots past a
sequence's length are redirected to the sequence's first slot, which it owns, so a
masked-out slot can never bring NaN or garbage into the result (0 * NaN would). A sliding
window masks the positions before it; attention sinks (gpt-oss), which SDPA cannot take, go
through the same product written out with the sink as one more softmax column.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagecli_kernels import fused_cpu, native
from pagecli_kernels._checks import (
    check_attention,
    check_lengths_host,
    check_store_kv,
    check_window_sinks,
)


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
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    block_size: int,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of every context position, padded to max_len, and the mask of the positions the
    sequence's last token sees (all before it, or with `window` the last `window`).

    Returns slots [num_seqs, max_len] int64 and valid [num_seqs, max_len] bool. Masked
    positions hold the slot of the sequence's last position (owned and finite; the mask hides
    it), so blocks outside the window are never read.
    """
    pos = torch.arange(max_len, device=block_tables.device)  # [max_len]
    lens = seq_lens.long().unsqueeze(1)  # [num_seqs, 1]
    valid = pos < lens  # [num_seqs, max_len]
    if window is not None:
        valid &= pos >= lens - window
    last = (lens - 1).clamp(min=0)  # [num_seqs, 1]
    safe_pos = torch.where(valid, pos, last)  # [num_seqs, max_len]
    block_ids = block_tables.gather(1, (safe_pos // block_size).to(torch.int64)).long()
    return block_ids * block_size + safe_pos % block_size, valid


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA over [B, H, n, D] queries and [B, KVH, L, D] keys/values (mask [.., n, L] bool,
    True where seen); with `sinks` [H], the softmax written out with the sink as a column."""
    if sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [B, H, L, D]
    values = values.repeat_interleave(group, dim=1)
    scores = (q.float() @ keys.float().transpose(-1, -2)) * scale  # [B, H, n, L]
    if causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # [B, H, n, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ values.float()).to(q.dtype)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
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
            window=window,
            sinks=sinks,
        )
    num_seqs = query.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    slots, valid = _padded_slots(block_tables, seq_lens, max_len, block_size, window)
    index = slots.view(-1)
    # [num_seqs, num_kv_heads, max_len, D]
    keys = _flat_slots(k_cache).index_select(0, index).view(num_seqs, max_len, num_kv_heads, -1)
    values = _flat_slots(v_cache).index_select(0, index).view(num_seqs, max_len, num_kv_heads, -1)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    mask = valid[:, None, None, :]  # [num_seqs, 1, 1, max_len]
    out = _attend(query.unsqueeze(2), keys, values, mask, scale, sinks)  # [S, H, 1, D]
    return out.squeeze(2)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its seq_lens[i] cached tokens (the last
    `window` of them with a window)."""
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens)
    check_window_sinks(window, sinks, query.shape[1], query.device)
    lens, _ = check_lengths_host(query, block_tables, seq_lens, cache.block_size)
    if not lens:
        return torch.empty_like(query)
    return _decode(query, k_cache, v_cache, block_tables, seq_lens, max(lens), scale, window, sinks)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens, the last of its seq_lens, over its cache
    (each token over the last `window` positions up to its own, with a window).

    The native kernel takes the whole batch in one call. On the torch path, sequences with a
    single new token run together as one decode batch; the others run one SDPA call each,
    over a context gathered for all of them at once.
    """
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_window_sinks(window, sinks, query.shape[1], query.device)
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
            window=window,
            sinks=sinks,
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
            window,
            sinks,
        )
    if not multi:
        return out

    # One gather for the contexts of all multi-token sequences, back to back: each from the
    # first position its first new token sees (0 without a window) to its end.
    firsts = [0 if window is None else max(0, lens[i] - query_lens[i] - window + 1) for i in multi]
    spans = [lens[i] - first for i, first in zip(multi, firsts)]
    multi_lens = torch.tensor(spans, device=query.device)  # [num_multi]
    ctx_starts = torch.cumsum(multi_lens, 0) - multi_lens
    owner = torch.repeat_interleave(torch.arange(len(multi), device=query.device), multi_lens)
    pos = torch.arange(int(multi_lens.sum()), device=query.device) - ctx_starts[owner]
    pos += torch.tensor(firsts, device=query.device)[owner]
    seq_ids = torch.tensor(multi, device=query.device)[owner]  # [total_ctx]
    slots = block_tables[seq_ids, pos // cache.block_size].long() * cache.block_size
    slots += pos % cache.block_size
    keys = _flat_slots(k_cache).index_select(0, slots)  # [total_ctx, num_kv_heads, D]
    values = _flat_slots(v_cache).index_select(0, slots)

    ctx_start = 0
    for i, first, span in zip(multi, firsts, spans):
        seq_len, query_len, start = lens[i], query_lens[i], starts[i]
        k = keys[ctx_start : ctx_start + span].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = values[ctx_start : ctx_start + span].transpose(0, 1).unsqueeze(0)
        ctx_start += span
        q = query[start : start + query_len].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if query_len == seq_len and window is None:
            mask, causal = None, True
        else:
            # New token j sits at position seq_len - query_len + j: bottom-right alignment.
            q_pos = torch.arange(query_len, device=query.device) + (seq_len - query_len)
            k_pos = torch.arange(first, seq_len, device=query.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False  # [n, L]
            if window is not None:
                mask &= k_pos[None, :] > q_pos[:, None] - window
        o = _attend(q, k, v, mask, scale, sinks, causal)  # [1, H, n, D]
        out[start : start + query_len] = o.squeeze(0).transpose(0, 1)
    return out
