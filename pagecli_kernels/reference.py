"""Simple, obviously-correct versions of every paged op: the test oracle.

Loops over sequences and tokens, math in float64, results cast back to the input dtype. Slow on
purpose; never call these from the engine.
"""

from __future__ import annotations

import torch

from pagecli_kernels._checks import (
    check_attention,
    check_lengths_host,
    check_store_kv,
    check_window_sinks,
)
from pagecli_kernels.quant_formats import QuantWeight


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key[i] / value[i] into cache slot slot_mapping[i]; negative slots are skipped."""
    cache = check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    num_slots = cache.num_blocks * cache.block_size
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        if slot >= num_slots:
            raise ValueError(f"slot_mapping[{i}] = {slot} is past the cache's {num_slots} slots")
        block_id, offset = divmod(slot, cache.block_size)
        k_cache[block_id, offset] = key[i]
        v_cache[block_id, offset] = value[i]


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, first: int = 0
) -> torch.Tensor:
    """The first seq_len tokens of one sequence, token by token: [seq_len, num_kv_heads, D];
    positions before `first` (no query sees them: a window's table may name no block there)
    are zeros."""
    block_size = cache.shape[1]
    rows = []
    for pos in range(seq_len):
        if pos < first:
            rows.append(torch.zeros_like(cache[0, 0]))
            continue
        block_id = int(block_table[pos // block_size])
        rows.append(cache[block_id, pos % block_size])
    return torch.stack(rows).to(torch.float64)


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of one query token over keys/values, in float64.

    query [num_heads, D]; keys, values [num_ctx, num_kv_heads, D]; returns [num_heads, D].
    `sinks` [num_heads]: a logit per head that joins the softmax's denominator and weighs no
    value (gpt-oss's attention sinks).
    """
    group = query.shape[0] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [num_ctx, num_heads, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", query.to(torch.float64), keys) * scale  # [H, num_ctx]
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(torch.float64)[:, None]], dim=-1)  # [H, ctx + 1]
        probs = torch.softmax(scores, dim=-1)[:, :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("ht,thd->hd", probs, values)


def _visible(pos: int, window: int | None) -> int:
    """The first context position a query at `pos` sees: pos - window + 1, or 0."""
    return 0 if window is None else max(0, pos - window + 1)


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
    `window` of them when a window is given)."""
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens)
    check_window_sinks(window, sinks, query.shape[1], query.device)
    lens, _ = check_lengths_host(query, block_tables, seq_lens, cache.block_size)
    out = torch.empty_like(query)  # [num_seqs, num_heads, D]
    for i, seq_len in enumerate(lens):
        first = _visible(seq_len - 1, window)
        keys = _gather_context(k_cache, block_tables[i], seq_len, first)
        values = _gather_context(v_cache, block_tables[i], seq_len, first)
        out[i] = _attend(query[i], keys[first:], values[first:], scale, sinks).to(query.dtype)
    return out


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
    """Causal attention of each sequence's new tokens, the last of its seq_lens, over its cache.

    New token j of a sequence with n new tokens sits at position p = seq_len - n + j and
    attends to positions 0..p (bottom-right aligned causal mask), or with a window to
    p - window + 1..p only.
    """
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_window_sinks(window, sinks, query.shape[1], query.device)
    lens, query_lens = check_lengths_host(
        query, block_tables, seq_lens, cache.block_size, query_start_loc
    )
    out = torch.empty_like(query)  # [num_tokens, num_heads, D]
    starts = query_start_loc.tolist()
    for i, (seq_len, query_len) in enumerate(zip(lens, query_lens, strict=True)):
        seen = _visible(seq_len - query_len, window)  # what its first new token sees
        keys = _gather_context(k_cache, block_tables[i], seq_len, seen)
        values = _gather_context(v_cache, block_tables[i], seq_len, seen)
        for j in range(query_len):
            pos = seq_len - query_len + j
            token = starts[i] + j
            first = _visible(pos, window)
            out[token] = _attend(
                query[token], keys[first : pos + 1], values[first : pos + 1], scale, sinks
            ).to(query.dtype)
    return out


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """A block-format weight's values, [rows, cols] float32, by gguf.quants.dequantize: the
    spec the kernels of quant_cpu.py match bit for bit."""
    import gguf

    values = gguf.quants.dequantize(
        weight.data.numpy(), gguf.GGMLQuantizationType(weight.format.ggml_type)
    )  # [rows, cols] float32
    return torch.from_numpy(values.reshape(weight.rows, weight.cols).copy())


def quant_linear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """`x @ dequant(weight).T` in float64, cast back to x's dtype: [..., cols] -> [..., rows]."""
    return (x.double() @ dequantize(weight).double().T).to(x.dtype)


def apply_token_bitmask(
    logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """A copy of logits `[S, V]` with -inf for each token t of row rows[r] that bit t % 32 of
    mask[r, t // 32] `[R, W]` int32 forbids, and for every t >= 32 * W."""
    out = logits.clone()
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=mask.device)  # [32]
    for r, row in enumerate(rows.tolist()):
        words = mask[r].to(torch.int64) & 0xFFFFFFFF  # [W], each word as uint32
        bits = (words[:, None] >> shifts) & 1  # [W, 32]: bit b of word w is token 32 * w + b
        allowed = torch.zeros(vocab, dtype=torch.bool, device=mask.device)  # [V]
        covered = min(vocab, bits.numel())
        allowed[:covered] = bits.flatten()[:covered] == 1
        out[row, ~allowed] = float("-inf")
    return out
