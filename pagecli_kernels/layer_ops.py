"""The ops of a layer program: what a model's decoder layers do, as csrc/layer_program_cpu.c
runs them. A model lists its layers' ops (pagecli/models/blocks.py); layers_cpu.LayerProgram
checks and binds the list once and runs it over each step in one native call.

Ops read and write the step's buffers, each [T, width] of the activations' dtype: "hidden"
(the residual stream, updated in place), "normed", "qkv", "attn", "proj", "gate_up", "act",
and for Gated DeltaNet layers "mixed" (the input projection) and "values" (the gated norm's
output). Columns are counted within a buffer's row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagecli_kernels.quant_formats import QuantWeight

# the C enum's order
BUFFERS = ("hidden", "normed", "qkv", "attn", "proj", "gate_up", "act", "mixed", "values")


@dataclass(frozen=True)
class Norm:
    """dst = RMSNorm(src) over `heads` heads of `width` values from column `src_col` (one
    head: `width` values of the row), into `dst` from `dst_col`; with `delta`, first
    src += delta (rows only). `weight_mode` 0: `weight` of the activations' dtype, applied
    after rounding; 1: float32, applied before (layers/norm.py's styles)."""

    src: str
    dst: str
    weight: torch.Tensor  # [width]
    eps: float
    width: int
    weight_mode: int = 0
    src_col: int = 0
    dst_col: int = 0
    heads: int = 1
    delta: str | None = None


@dataclass(frozen=True)
class Linear:
    """dst = src @ W.T (+ bias), W the parts stacked by rows; whole rows of both buffers."""

    src: str
    dst: str
    parts: tuple[QuantWeight, ...]  # block-format or float rows, 1 to MAX_PARTS
    bias: torch.Tensor | None  # [out_features] float32
    in_features: int
    out_features: int


@dataclass(frozen=True)
class Rotary:
    """q heads from `q_col` and k heads from `k_col` of `buf` rotated in place by the step's
    rope table `rope` (its rotary width R <= head_dim: the first R values of each head).
    `pairs`: heads in llama.cpp's interleaved order, left in transformers'."""

    buf: str
    q_col: int
    k_col: int
    q_heads: int
    k_heads: int
    head_dim: int
    rope: int
    pairs: bool = False


@dataclass(frozen=True)
class Attention:
    """Store the step's k, v rows (from `src` at k_col, v_col) into the layer's caches, then
    paged attention of q (from q_col) over each sequence's cache, with the layer's window and
    sinks, into `dst` (whole rows of num_heads * head_dim)."""

    src: str
    q_col: int
    k_col: int
    v_col: int
    dst: str
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    sinks: torch.Tensor | None  # [num_heads] float32
    scale: float
    kv_group: int = 0  # whose slots and block tables it reads (engine/kv_groups.py)


@dataclass(frozen=True)
class ActMul:
    """dst = act(gate) * up, gate and up side by side in src ([2 * inter] per row)."""

    src: str
    dst: str
    inter: int
    activation: str  # "silu" or "gelu_tanh"


@dataclass(frozen=True)
class Add:
    """dst += src, or dst += src * scale (the product rounded first: torch's order)."""

    dst: str
    src: str
    scale: float | None = None


@dataclass(frozen=True)
class AllReduce:
    """`buf` summed over the tensor-parallel ranks (a no-op on one rank)."""

    buf: str


@dataclass(frozen=True)
class SplitHeads:
    """Per row of `buf`, `heads` pairs of `width` values from `col`, [x0 y0 x1 y1 ...], put
    in place as [x0 x1 ... y0 y1 ...] (gated attention: each head's query, then its gate)."""

    buf: str
    col: int
    heads: int
    width: int


@dataclass(frozen=True)
class GateMul:
    """dst[:, :width] *= sigmoid(src[:, src_col : src_col + width]) (float32)."""

    dst: str
    src: str
    src_col: int
    width: int


@dataclass(frozen=True)
class DeltaNet:
    """A Gated DeltaNet layer's step (csrc/gated_delta_cpu.c) from its input projection in
    `src` (whole rows: conv channels, z, b, a) into `dst` (whole rows of Hv * dv); each
    sequence's state comes from `conv_states` / `ssm_states` at its slot (float32)."""

    src: str
    dst: str
    conv_weight: torch.Tensor  # [C, K] float32
    a: torch.Tensor  # [Hv] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm_weight: torch.Tensor  # [dv] float32
    eps: float
    conv_states: torch.Tensor  # [slots, C, K - 1] float32
    ssm_states: torch.Tensor  # [slots, Hv, dk, dv] float32
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    tiled: bool


@dataclass(frozen=True)
class MoE:
    """A sparse mixture-of-experts MLP from `src` into `dst` (whole rows of the hidden size;
    float32): `table` is the layer's MOE_FIELDS table (layers/moe.py builds it), `keep` the
    tensors its pointers reach."""

    src: str
    dst: str
    table: torch.Tensor  # [MOE_FIELDS] int64
    keep: tuple


Op = (
    Norm
    | Linear
    | Rotary
    | Attention
    | ActMul
    | Add
    | AllReduce
    | SplitHeads
    | GateMul
    | DeltaNet
    | MoE
)
