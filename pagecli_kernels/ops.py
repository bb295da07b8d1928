"""The public paged ops: one signature, dispatched to Triton, the fast CPU path or the reference.
Beside them, the sampler's op that applies a grammar's token bitmask to the logits.

`impl` picks the implementation:
  "auto"       Triton for CUDA tensors, the fast CPU path for CPU tensors
  "triton"     the Triton kernel; on CPU tensors it needs Triton's interpreter, i.e.
               TRITON_INTERPRET=1 set before triton is first imported (tests do this in
               tests/kernels/conftest.py)
  "cpu"        the fast torch path (pagecli_kernels/cpu.py); for the token bitmask the C kernel
               of fused_cpu.py where it takes the tensors, else a vectorized torch path
  "reference"  the float64 loops (pagecli_kernels/reference.py)

Triton is imported only when a Triton kernel is first asked for, so CPU-only installs never
need it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Literal

import torch

from pagecli_kernels import cpu, fused_cpu, reference

Impl = Literal["auto", "triton", "cpu", "reference"]
IMPLS = ("auto", "triton", "cpu", "reference")


def _resolve(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if impl == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "impl='triton' on CPU tensors runs Triton's interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported"
        )
    return impl


def _triton_launcher(module_name: str, launcher_name: str):
    """The launcher `launcher_name` of pagecli_kernels/<module_name>.py, imported on first use."""
    package = sys.modules[__package__]
    module = importlib.import_module(f"{__package__}.{module_name}")
    # Importing pagecli_kernels.store_kv binds the package attribute `store_kv` to the module;
    # put the public op back so `pagecli_kernels.store_kv(...)` keeps working.
    package.store_kv = store_kv
    return getattr(module, launcher_name)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    impl: Impl = "auto",
) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the paged caches in place.

    slot_mapping `[num_tokens]` int64 holds block_id * block_size + offset per token; a
    negative slot is skipped.
    """
    impl = _resolve(impl, k_cache.device)
    if impl == "triton":
        fn = _triton_launcher("store_kv", "store_kv")
    else:
        fn = cpu.store_kv if impl == "cpu" else reference.store_kv
    fn(key, value, k_cache, v_cache, slot_mapping)


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
    impl: Impl = "auto",
) -> torch.Tensor:
    """Attention of one new token per sequence over its seq_lens[i] cached tokens.

    query and the result are `[num_seqs, num_heads, head_dim]`; caches
    `[num_blocks, block_size, num_kv_heads, head_dim]`; block_tables
    `[num_seqs, max_blocks_per_seq]` int32; seq_lens `[num_seqs]` int32.
    `window`: the query sees only the last `window` positions, itself included (a sliding
    window as transformers counts it); `sinks` `[num_heads]` float: one logit per head that
    joins the softmax's denominator and weighs no value (gpt-oss).
    """
    impl = _resolve(impl, query.device)
    if impl == "triton":
        fn = _triton_launcher("decode_attention", "paged_decode_attention")
    else:
        fn = cpu.paged_decode_attention if impl == "cpu" else reference.paged_decode_attention
    return fn(query, k_cache, v_cache, block_tables, seq_lens, scale, window=window, sinks=sinks)


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
    impl: Impl = "auto",
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    query and the result are `[num_tokens, num_heads, head_dim]`, sequences back to back as
    delimited by query_start_loc `[num_seqs + 1]` int32. A sequence's new tokens are the last
    ones of its seq_lens (K/V already stored), so the causal mask is bottom-right aligned.
    `window` and `sinks` as for paged_decode_attention.
    """
    impl = _resolve(impl, query.device)
    if impl == "triton":
        fn = _triton_launcher("prefill_attention", "paged_prefill_attention")
    elif impl == "cpu":
        fn = cpu.paged_prefill_attention
    else:
        fn = reference.paged_prefill_attention
    return fn(
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        window=window,
        sinks=sinks,
    )


def _check_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a [S, V] float tensor, got {logits.dtype} of shape "
            f"{tuple(logits.shape)}"
        )
    if mask.dim() != 2 or mask.dtype != torch.int32:
        raise ValueError(
            f"mask must be [R, W] int32, got {mask.dtype} of shape {tuple(mask.shape)}"
        )
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.shape[0] != mask.shape[0]:
        raise ValueError(
            f"rows must be [R] int64 with R = {mask.shape[0]} (mask's rows), got {rows.dtype} "
            f"of shape {tuple(rows.shape)}"
        )
    for name, tensor in (("mask", mask), ("rows", rows)):
        if tensor.device != logits.device:
            raise ValueError(f"{name} is on {tensor.device}, logits on {logits.device}")


def _apply_token_bitmask_torch(
    logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> None:
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)  # [32]
    # an arithmetic shift of a negative word still leaves bit b in bit 0
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [R, <= V]
    if allowed.shape[1] < vocab:  # tokens the mask does not cover are forbidden
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask_(
    logits: torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor,
    *,
    impl: Impl = "auto",
) -> None:
    """Forbid, in place, the tokens a grammar's bitmask forbids: logits[rows[r], t] = -inf
    unless bit t % 32 of mask[r, t // 32] is set (llguidance's layout), and for t >= 32 * W.

    logits `[S, V]` float (rows may be padded); mask `[R, W]` int32, W = ceil(V / 32) as a
    rule; rows `[R]` int64, distinct, in [0, S). Unlisted rows are untouched.
    """
    _check_token_bitmask(logits, mask, rows)
    impl = _resolve(impl, logits.device)
    if impl == "triton":
        _triton_launcher("token_bitmask", "apply_token_bitmask_")(logits, mask, rows)
    elif impl == "reference":
        logits.copy_(reference.apply_token_bitmask(logits, mask, rows))
    elif logits.dtype == torch.float32 and logits.stride(-1) == 1 and fused_cpu.available(logits):
        fused_cpu.apply_token_bitmask_(logits, mask.contiguous(), rows)
    else:
        _apply_token_bitmask_torch(logits, mask, rows)
