"""Triton paged attention for prefill chunks over a cached prefix (flash-attention style).

One program handles BLOCK_M new tokens of one sequence for one query head and walks that
sequence's context through its block table, BLOCK_N tokens at a time, with an online softmax.
Query slices (BLOCK_M new tokens) of all sequences share one flat grid axis: sequence i's
slices start at query_start_loc[i] // BLOCK_M + i, a monotone start that the kernel
binary-searches, so the launcher never reads query_start_loc (no device sync, CUDA-graph
friendly).

With a sliding window of w tokens the new token at position p sees positions
max(0, p - w + 1)..p only: a program starts its walk at its first row's window start, so no
K/V row or block-table entry before it is read, and masks the rest per row. An attention sink
(one logit per query head) joins the softmax's denominator: the running max starts at the sink
and the running sum at 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecli_kernels._checks import check_attention, check_window_sinks
from pagecli_kernels._triton_utils import check_triton_support, interpreting


def launch_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Slice and chunk sizes and launch options for one head_dim and dtype (the compile test
    uses these)."""
    if dtype == torch.float32:
        # float32 operands take twice the registers of 16-bit ones: smaller blocks, more warps
        # (4 warps spill on sm_90 for head_dim > 64).
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _prefill_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    sinks_ptr,
    out_ptr,
    scale,
    window,
    num_seqs,
    stride_query_token,
    stride_query_head,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    stride_block_tables_seq,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Program (query slice, query head); window > 0: each new token sees its last `window`
    # positions, 0: all of them.
    q_slice = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Find the sequence owning this slice: the last i with start_slice(i) <= q_slice.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        lo = tl.where(mid_start <= q_slice, mid + 1, lo)
        hi = tl.where(mid_start <= q_slice, hi, mid)
    seq = lo - 1
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len
    row_start = (q_slice - (query_start // BLOCK_M + seq)) * BLOCK_M

    rows = row_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
    row_mask = rows < query_len
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    tokens = (query_start + rows).to(tl.int64)
    q = tl.load(
        query_ptr + tokens[:, None] * stride_query_token + head * stride_query_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    q_pos = prefix_len + rows  # context position of each new token
    # First position each row sees, its window's start (0 without a window, and for the
    # padding rows past the new tokens, which are not stored: they then see every loaded
    # position, not none, so that their 0/0 never happens).
    q_first = tl.where(row_mask & (window > 0), tl.maximum(q_pos - window + 1, 0), 0)
    # Causal bound of the slice's last valid row; 0 for a slice past the sequence's new tokens.
    context_end = tl.where(
        row_start < query_len, prefix_len + tl.minimum(row_start + BLOCK_M, query_len), 0
    )
    # Window start of the slice's first row, the lowest of its rows: K/V chunks wholly before it
    # are skipped, and nothing before it is loaded. The walk starts on a multiple of BLOCK_N,
    # as without a window, which keeps the gather's addressing as cheap (registers).
    context_start = tl.where(window > 0, tl.maximum(prefix_len + row_start - window + 1, 0), 0)
    walk_start = context_start // BLOCK_N * BLOCK_N

    if HAS_SINKS:
        # The sink is one more softmax term that weighs no value: e^(sink - m_i) = 1 to start.
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        # float32's lowest, not -inf: a row that sees nothing of a chunk (its window starts past
        # it) keeps alpha = e^0 = 1 and p = 0, where -inf - -inf would make NaN.
        m_i = tl.full([BLOCK_M], -3.4028234663852886e38, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    for start in range(walk_start, context_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        pos_mask = (pos >= context_start) & (pos < context_end)
        block_ids = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0)
        block_ids = block_ids.to(tl.int64)
        offsets = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block_ids[:, None] * stride_k_cache_block
            + offsets[:, None] * stride_k_cache_slot
            + kv_head * stride_k_cache_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_v_cache_block
            + offsets[:, None] * stride_v_cache_slot
            + kv_head * stride_v_cache_head
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
        # Bottom-right causal mask and each row's window.
        visible = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] >= q_first[:, None])
        visible = visible & pos_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_out_token + head * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


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
    (each token over its last `window` positions with a window); `sinks` [num_heads]: one
    softmax logit per head that weighs no value."""
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    check_window_sinks(window, sinks, query.shape[1], query.device)
    check_triton_support(cache.head_dim, cache.block_size, query, k_cache, v_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)  # [num_tokens, num_heads, D]
    if num_tokens == 0 or num_seqs == 0:
        return out
    config = launch_config(head_dim, query.dtype)
    # An upper bound on the number of query slices (see the module docstring).
    num_slices = num_tokens // config["BLOCK_M"] + num_seqs
    # 0: no window. A window past the table's capacity cuts nothing: clamped there (an int32).
    window_arg = 0 if window is None else min(window, block_tables.shape[1] * cache.block_size)
    _prefill_attention_kernel[(num_slices, num_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out if sinks is None else sinks.contiguous(),  # out: a pointer never read
        out,
        scale,
        window_arg,
        num_seqs,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=num_heads // cache.num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=cache.block_size,
        HAS_SINKS=sinks is not None,
        UPCAST=interpreting() or query.dtype == torch.float32,
        **config,
    )
    return out
