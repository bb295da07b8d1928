"""Triton kernel applying a grammar's token bitmask (llguidance's layout) to logits in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagecli_kernels._checks import SUPPORTED_DTYPES
from pagecli_kernels._triton_utils import interpreting

BLOCK_WORDS = 32  # mask words per program: 1024 tokens


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab,
    mask_words,
    stride_logits_row,
    stride_bitmask_row,
    BLOCK_WORDS: tl.constexpr,
):
    # One program per (listed row, BLOCK_WORDS * 32 tokens). Only forbidden tokens are stored,
    # so the logits are never read.
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)  # int64, so row * stride cannot overflow
    words = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # [BLOCK_WORDS]
    bits = tl.arange(0, 32)
    tokens = words[:, None] * 32 + bits[None, :]  # [BLOCK_WORDS, 32]
    # words past the mask read as 0: tokens it does not cover are forbidden
    word = tl.load(bitmask_ptr + r * stride_bitmask_row + words, mask=words < mask_words, other=0)
    # an arithmetic shift of a negative word still leaves bit b in bit 0
    forbidden = (((word[:, None] >> bits[None, :]) & 1) == 0) & (tokens < vocab)
    neg_inf = tl.full([BLOCK_WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits_row + tokens, neg_inf, mask=forbidden)


def apply_token_bitmask_(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set logits[rows[r], t] = -inf in place for each token t that bit t % 32 of
    mask[r, t // 32] forbids, and for t >= 32 * W. logits `[S, V]`, mask `[R, W]` int32,
    rows `[R]` distinct int64 in [0, S) (not checked: reading them would sync the device)."""
    if logits.dim() != 2 or logits.dtype not in SUPPORTED_DTYPES or logits.stride(-1) != 1:
        raise ValueError(
            "logits must be [S, V] float32, float16 or bfloat16 with unit column stride, got "
            f"{logits.dtype} of shape {tuple(logits.shape)}, strides {tuple(logits.stride())}"
        )
    if mask.dim() != 2 or mask.dtype != torch.int32 or mask.stride(-1) != 1:
        raise ValueError(
            f"mask must be [R, W] int32 with unit column stride, got {mask.dtype} of shape "
            f"{tuple(mask.shape)}, strides {tuple(mask.stride())}"
        )
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rows must be [R] int64 with R = {mask.shape[0]} (mask's rows), got {rows.dtype} "
            f"of shape {tuple(rows.shape)}"
        )
    for tensor in (logits, mask, rows):
        if tensor.device.type == "cpu" and not interpreting():
            raise ValueError(
                "the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton "
                "is imported to run them on the CPU"
            )
    num_rows, vocab = rows.shape[0], logits.shape[1]
    if num_rows == 0 or vocab == 0:
        return
    grid = (num_rows, triton.cdiv(vocab, 32 * BLOCK_WORDS))
    _apply_token_bitmask_kernel[grid](
        logits,
        mask,
        rows,
        vocab,
        mask.shape[1],
        logits.stride(0),
        mask.stride(0),
        BLOCK_WORDS=BLOCK_WORDS,
        num_warps=4,
    )
