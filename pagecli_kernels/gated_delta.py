"""Triton kernel of the Gated DeltaNet recurrence (layers/gated_delta.py), for CUDA.

One program per (sequence, value head, block of BLOCK_V state columns): it loads its
[dk, BLOCK_V] block of the sequence's state once, takes the sequence's tokens of the step one
by one (a decode's one, a prefill chunk's many: decay, the delta rule, the read-out), writes
each token's output columns, and stores the block back. The columns of a state are
independent in the delta rule (S^T k and S^T q sum over its rows), so the blocks never meet.
Every sequence of a step, decodes and prefill chunks alike, goes in one launch.

The inputs are what the layer computes before the recurrence: q and k l2-normalized per key
head (q scaled by dk^-1/2), v, the log decay g and beta per value head, all float32; value
head h reads key head h // (Hv / Hk), or h mod Hk with TILED (llama.cpp's GGUF order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecli_kernels._triton_utils import interpreting

SUPPORTED_K_DIMS = (16, 32, 64, 128, 256)  # powers of two: one tl.arange per key head


def block_v(v_dim: int) -> int:
    """State columns per program: 32 (a [128, 32] float32 block is 32 registers a thread at
    4 warps), fewer for narrower heads."""
    return min(32, v_dim)


@triton.jit
def _gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    out_ptr,
    slots_ptr,
    starts_ptr,
    num_k_heads,
    num_v_heads,
    stride_q,
    stride_k,
    stride_v,
    stride_g,
    stride_out,
    K_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_V: tl.constexpr,
    TILED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + seq)  # int64: slot * state size cannot overflow
    start = tl.load(starts_ptr + seq)
    end = tl.load(starts_ptr + seq + 1)
    if TILED:
        k_head = head % num_k_heads
    else:
        k_head = head // (num_v_heads // num_k_heads)
    rows = tl.arange(0, K_DIM)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    block = state_ptr + (slot * num_v_heads + head) * K_DIM * V_DIM
    block = block + rows[:, None] * V_DIM + cols[None, :]
    state = tl.load(block)  # [K_DIM, BLOCK_V]
    for t in range(start, end):
        q = tl.load(q_ptr + t * stride_q + k_head * K_DIM + rows)  # [K_DIM]
        k = tl.load(k_ptr + t * stride_k + k_head * K_DIM + rows)
        v = tl.load(v_ptr + t * stride_v + head * V_DIM + cols)  # [BLOCK_V]
        decay = tl.exp(tl.load(g_ptr + t * stride_g + head))
        beta = tl.load(beta_ptr + t * stride_g + head)
        state = state * decay
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(out_ptr + t * stride_out + head * V_DIM + cols, out)
    tl.store(block, state)


def gated_delta_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    tiled: bool = False,
) -> torch.Tensor:
    """The recurrence over a step's sequences: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]
    (float32, rows of unit stride within a token), states [slots, Hv, dk, dv] float32
    (contiguous, updated in place at `slots` [S] int64), sequence s the tokens from `starts`
    [S + 1] int32. Returns o [T, Hv, dv] float32."""
    num_tokens, num_k_heads, k_dim = k.shape
    num_v_heads, v_dim = v.shape[1:]
    if k_dim not in SUPPORTED_K_DIMS or q.shape != k.shape:
        raise ValueError(
            f"key heads of {k_dim} are not supported by the Triton kernel; supported: "
            f"{', '.join(map(str, SUPPORTED_K_DIMS))}"
        )
    bv = block_v(v_dim)
    if v_dim % bv or bv & (bv - 1) or num_v_heads % num_k_heads:
        raise ValueError(f"{num_v_heads} value heads of {v_dim} over {num_k_heads} key heads")
    tensors = (q, k, v, g, beta, states)
    if any(t.dtype != torch.float32 for t in tensors) or not states.is_contiguous():
        raise ValueError("q, k, v, g, beta and the states must be float32 (states contiguous)")
    if states.shape[1:] != (num_v_heads, k_dim, v_dim):
        raise ValueError(f"states of shape {tuple(states.shape)} for this layer")
    if any(t.stride(-1) != 1 for t in (q, k, v, g, beta)) or any(
        t.stride(1) != t.shape[2] for t in (q, k, v)
    ):
        raise ValueError("q, k, v: heads back to back in each token's row; g, beta: unit stride")
    if g.shape != beta.shape or g.stride(0) != beta.stride(0):
        raise ValueError("g and beta must be [T, Hv] of one layout")
    if slots.dtype != torch.int64 or starts.dtype != torch.int32:
        raise ValueError("slots must be int64, starts int32")
    for tensor in (q, states):
        if tensor.device.type == "cpu" and not interpreting():
            raise ValueError(
                "the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                "is imported to run them on the CPU"
            )
    out = torch.empty(num_tokens, num_v_heads, v_dim, dtype=torch.float32, device=v.device)
    num_seqs = slots.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    grid = (num_seqs, num_v_heads, v_dim // bv)
    _gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        states,
        out,
        slots,
        starts,
        num_k_heads,
        num_v_heads,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        g.stride(0),
        out.stride(0),
        K_DIM=k_dim,
        V_DIM=v_dim,
        BLOCK_V=bv,
        TILED=tiled,
        num_warps=4,
    )
    return out
