"""Triton paged attention for decode: one new query token per sequence.

The context of each sequence is split across programs (split-K) so that a few long sequences
still fill the GPU: `_decode_attention_kernel` computes, for one (sequence, KV head, split), the
running max, the softmax denominator and the unnormalized output of up to 16 of the query heads
sharing that KV head (each chunk of K/V is loaded once for all of them); `_decode_reduce_kernel`
merges the splits. With a single split the first
kernel normalizes and writes the output itself.

With a sliding window of w tokens the new token at position seq_len - 1 sees positions
[max(0, seq_len - w), seq_len) only: the splits cover that range, and no K/V row or block-table
entry before it is read. An attention sink (one logit per query head) joins the softmax's
denominator once: in the single-split kernel, whose running max starts at the sink and running
sum at 1, or in the reduce kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecli_kernels._checks import check_attention, check_window_sinks
from pagecli_kernels._triton_utils import check_triton_support, interpreting

MAX_SPLITS = 32
# Query heads per program; tl.dot needs at least 16 rows. Larger GQA groups take several
# programs per KV head, so register use does not grow with the group.
BLOCK_H = 16


def launch_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Chunk size and launch options for one head_dim and dtype (the compile test uses these).

    BLOCK_N context tokens per chunk; a chunk gathers its tokens' slots through the block
    table, so it does not depend on the cache's block size.
    """
    if dtype == torch.float32:
        # float32 operands double the registers; 4 warps spill on sm_90 for head_dim 128.
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


@triton.jit
def _decode_attention_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    partial_out_ptr,
    scale,
    window,
    tokens_per_split,
    stride_query_seq,
    stride_query_head,
    stride_k_cache_block,
    stride_k_cache_slot,
    stride_k_cache_head,
    stride_v_cache_block,
    stride_v_cache_slot,
    stride_v_cache_head,
    stride_block_tables_seq,
    stride_out_seq,
    stride_out_head,
    num_heads,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Program (seq, kv_head * num_chunks + chunk, split): BLOCK_H of the GROUP query heads that
    # share kv_head, over one split of the context the new token sees (window > 0: its last
    # `window` positions; 0: all of them).
    seq = tl.program_id(0)
    num_chunks = (GROUP + BLOCK_H - 1) // BLOCK_H
    kv_head = tl.program_id(1) // num_chunks
    chunk = tl.program_id(1) % num_chunks
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    window_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_start = window_start + split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)

    group_rows = chunk * BLOCK_H + tl.arange(0, BLOCK_H)  # padded to 16 rows for tl.dot
    heads = kv_head * GROUP + group_rows
    row_mask = group_rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q = tl.load(
        query_ptr + seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_SINKS and NUM_SPLITS == 1:
        # The sink is one more softmax term that weighs no value: e^(sink - m_i) = 1 to start.
        # With several splits the reduce kernel adds it, once.
        m_i = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_H]
        l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_tables_seq
    for start in range(split_start, split_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        pos_mask = pos < split_end
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
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N]
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # partial_* are contiguous [num_seqs, num_heads, NUM_SPLITS(, BLOCK_D)] float32.
        row = (seq * num_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(partial_max_ptr + row, m_i, mask=row_mask)
        tl.store(partial_sum_ptr + row, l_i, mask=row_mask)
        tl.store(partial_out_ptr + row[:, None] * BLOCK_D + dims[None, :], acc, mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    seq_lens_ptr,
    sinks_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    partial_out_ptr,
    out_ptr,
    window,
    tokens_per_split,
    stride_out_seq,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    # One program per (sequence, query head): merge the splits that hold context tokens, the
    # ones over [window_start, seq_len).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    window_start = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    num_used = tl.cdiv(seq_len - window_start, tokens_per_split)
    splits = tl.arange(0, NUM_SPLITS)
    split_mask = splits < num_used
    dims = tl.arange(0, BLOCK_D)

    row = (seq * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS + splits  # [NUM_SPLITS]
    m = tl.load(partial_max_ptr + row, mask=split_mask, other=float("-inf"))
    l_split = tl.load(partial_sum_ptr + row, mask=split_mask, other=0.0)
    acc = tl.load(
        partial_out_ptr + row[:, None] * BLOCK_D + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )  # [NUM_SPLITS, BLOCK_D]
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    weight = tl.where(split_mask, tl.exp(m - m_max), 0.0)  # [NUM_SPLITS]
    total = tl.sum(l_split * weight, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m_max)  # the sink's softmax term, which weighs no value
    out = tl.sum(acc * weight[:, None], 0) / total  # [BLOCK_D]
    tl.store(
        out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def _num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device
) -> int:
    """How many programs share one sequence's context, from shapes only (no device sync)."""
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # the interpreter: a few splits so that tests cross split boundaries
    wanted = triton.cdiv(target, num_seqs * num_kv_heads)
    # Each split keeps at least a few chunks of work.
    most = triton.cdiv(max_context, 4 * block_n) if device.type == "cuda" else max_context
    return triton.next_power_of_2(max(1, min(wanted, most, MAX_SPLITS)))


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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its seq_lens[i] cached tokens (the last
    `window` of them with a window); `sinks` [num_heads]: one softmax logit per head that
    weighs no value.

    num_splits overrides the split-K heuristic (a power of two up to 32; tests use it).
    """
    cache = check_attention(query, k_cache, v_cache, block_tables, seq_lens)
    check_window_sinks(window, sinks, query.shape[1], query.device)
    check_triton_support(cache.head_dim, cache.block_size, query, k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)  # [num_seqs, num_heads, D]
    if num_seqs == 0:
        return out
    group = num_heads // cache.num_kv_heads
    # Upper bound on any sequence's visible context, known without reading seq_lens. A window
    # past the table's capacity cuts nothing: the kernels get it clamped there (an int32).
    max_context = block_tables.shape[1] * cache.block_size
    if window is not None:
        max_context = min(max_context, window)
    window_arg = 0 if window is None else max_context  # 0: no window
    config = launch_config(head_dim, query.dtype)
    block_n = config["BLOCK_N"]
    if num_splits is None:
        num_splits = _num_splits(num_seqs, cache.num_kv_heads, max_context, block_n, query.device)
    elif num_splits not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_splits must be a power of two in [1, 32], got {num_splits}")
    # A multiple of BLOCK_N so that only the last split of a sequence has a partial chunk.
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    block_d = triton.next_power_of_2(head_dim)
    if num_splits == 1:
        partial_max = partial_sum = partial_out = out  # unused
    else:
        partial_max = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, block_d), dtype=torch.float32, device=query.device
        )
    sinks_arg = out if sinks is None else sinks.contiguous()  # out: a pointer never read
    num_chunks = triton.cdiv(group, BLOCK_H)
    _decode_attention_kernel[(num_seqs, cache.num_kv_heads * num_chunks, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        sinks_arg,
        out,
        partial_max,
        partial_sum,
        partial_out,
        scale,
        window_arg,
        tokens_per_split,
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
        num_heads,
        GROUP=group,
        BLOCK_H=BLOCK_H,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=cache.block_size,
        NUM_SPLITS=num_splits,
        HAS_SINKS=sinks is not None,
        UPCAST=interpreting() or query.dtype == torch.float32,
        **config,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            seq_lens,
            sinks_arg,
            partial_max,
            partial_sum,
            partial_out,
            out,
            window_arg,
            tokens_per_split,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
    return out
