"""Triton fused mixture of experts (layers/moe.py) for CUDA: each chosen expert's weights
read once per block of the tokens that chose it, as vLLM's fused_moe does.

A step's (token, choice) pairs are sorted by expert, each expert's run padded to BLOCK_M
(`align`: the pairs in order, a pad value past them, and each block's expert). One program per
(block of BLOCK_M pairs of one expert, BLOCK_N output columns) gathers its pairs' input rows,
multiplies them by the expert's [BLOCK_N, K] weights in BLOCK_K steps into a float32
accumulator, adds the expert's bias, and writes each pair's row. The MoE runs two such
launches: gate_up for every pair (its token's row of x), then, after the activation over those
rows, down (each pair's own row), scaled by the pair's routing weight; a token's k rows are
summed last. float32 products are exact IEEE products (no TF32), so float32 results follow the
torch loop's to rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # pairs per program: tl.dot's least
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _grouped_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    route_ptr,
    pairs_ptr,
    experts_ptr,
    N,
    K,
    num_pairs,
    stride_a,
    stride_we,
    stride_wn,
    stride_c,
    ROWS_PER_PAIR: tl.constexpr,  # top_k: pair p reads x's row p // top_k; 1: its own row
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m)  # int64; the padding is num_pairs
    valid = pairs < num_pairs
    expert = tl.load(experts_ptr + block)  # int64
    rows = pairs // ROWS_PER_PAIR
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_a + offs_k[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTE:
        acc *= tl.load(route_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c_ptr + pairs[:, None] * stride_c + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def align(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """The pairs of `experts` [T, k] (each token's chosen experts) sorted by expert, each
    expert's run padded to a multiple of block_m with T * k: (pairs [P], expert of each block
    [P / block_m]); stable, so an expert's pairs keep the tokens' order."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    pairs, owners = [], []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        run = order[start : start + count]
        start += count
        padded = -(-count // block_m) * block_m
        pad = torch.full((padded - count,), num_pairs, dtype=order.dtype, device=order.device)
        pairs += [run, pad]
        owners += [expert] * (padded // block_m)
    sorted_pairs = torch.cat(pairs).to(torch.int64)
    block_experts = torch.tensor(owners, dtype=torch.int64, device=experts.device)
    return sorted_pairs, block_experts


def grouped_linear(
    a: torch.Tensor,
    weights: torch.Tensor,
    bias: torch.Tensor | None,
    pairs: torch.Tensor,
    block_experts: torch.Tensor,
    num_pairs: int,
    rows_per_pair: int,
    route: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[p] = a[p // rows_per_pair] @ weights[e_p].T (+ bias[e_p]) (* route[p]) for every
    pair p of `pairs` (align's order): a [R, K], weights [E, N, K], bias [E, N] -> [P, N]."""
    num_experts, n, k = weights.shape
    if a.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("grouped_linear: rows must have unit stride")
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_kernel[grid](
        a, weights, bias if bias is not None else a, out,
        route if route is not None else a, pairs, block_experts,
        n, k, num_pairs, a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        ROWS_PER_PAIR=rows_per_pair, HAS_BIAS=bias is not None, MUL_ROUTE=route is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out


def fused_moe(
    x: torch.Tensor,
    route: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' sum for x [T, H]: route [T, k] (routing weights, x's dtype),
    experts [T, k] (int64), gate_up [E, 2I, H] (gate rows first), down [E, H, I], biases
    [E, 2I] and [E, H]; activation(gate_up rows [P, 2I]) -> [P, I]. Returns [T, H]."""
    num_tokens, top_k = experts.shape
    pairs, block_experts = align(experts, gate_up.shape[0])
    num_pairs = num_tokens * top_k
    x = x.contiguous()
    first = grouped_linear(x, gate_up, gate_up_bias, pairs, block_experts, num_pairs, top_k)
    act = activation(first).contiguous()  # [P, I]
    flat_route = route.reshape(-1).contiguous()
    second = grouped_linear(act, down, down_bias, pairs, block_experts, num_pairs, 1, flat_route)
    return second.view(num_tokens, top_k, -1).sum(dim=1)
