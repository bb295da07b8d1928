"""Linear layers with their weights packed once for oneDNN, for the CPU.

A plain `F.linear` on the CPU hands the weight to MKL's GEMM, which repacks it into its
blocked layout on every call. For a prefill of thousands of tokens that cost disappears under
the arithmetic; for a decode step of a few dozen tokens it does not: the weights are streamed
from memory once to pack and again to multiply, and small decode batches ran at half the
memory bandwidth. Packing each weight once at load time into oneDNN's blocked layout (the
format oneDNN picks for a batch of `BATCH_HINT` rows; it serves any batch size) roughly
halves the time of decode-sized products here (see benchmarks/RESULTS.md).

With the native CPU library, float32 projections without a bias take its kernels instead
(`models/weight_methods.prepare_float32`, pagecli_kernels/quant_formats.F32); packing serves
the rest.

The packed forward is the same product with a different summation order, so results differ
from `F.linear` by float32 rounding only (`tests/unit/test_linear.py` bounds it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagecli_kernels import host_memory, quant_cpu
from pagecli_kernels.quant_formats import QuantWeight, float_rows

BATCH_HINT = 64  # rows the packed layout is tuned for; measured best for decode batches


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether this torch build can pack linear weights for `dtype` on `device`."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` with the weight held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(x2d, self.packed, self.bias, "none", [], "")
        return out.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(module: nn.Module) -> int:
    """Replace every `nn.Linear` below `module` by a `PackedLinear`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
            count += 1
        else:
            count += pack_linears(child)
    return count


def bf16_rows_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bfloat16 linear layers on `device` can take `BF16Linear`'s row kernels."""
    return device.type == "cpu" and dtype == torch.bfloat16 and quant_cpu.library() is not None


class BF16Linear(nn.Module):
    """A bfloat16 `y = x @ weight.T + bias` for the CPU on the native kernels
    (pagecli_kernels/quant_cpu.bf16_linear, over a view of the same weight, no copy).

    Products of up to `quant_cpu.fused_rows()` rows (8, or as many as the `fused_rows`
    setting asks for: a step that checks drafts asks for its rows,
    engine/spec_decode/invariance.py) take the row kernels, where each row has the bits it has
    alone, as the block formats' products do: torch's bfloat16 product of one or two rows read
    the weights at a third of the machine's bandwidth (Zen 4 with AVX512_BF16, 2 threads), and
    its rows' bits depend on their batch. Larger ones take csrc/gemm_bf16.c's GEMM where
    `quant_cpu.bf16_gemm()` names one (the one-call decoder layers run it too): "pairs"
    (AVX512_BF16 without AMX: as fast as oneDNN's) and "float32" (the AVX2 path: the input
    widened, the float32 panels; torch's GEMM ran at a third to an eighth of their rate
    there) for every size, "tiles" (AMX) up to `TILES_ROWS` rows; torch's GEMM otherwise.
    All of them sum the exact products of the bfloat16 values in float32, as oneDNN's
    bfloat16 GEMM does, so the result differs from `F.linear` in summation order only before
    the output is rounded to bfloat16."""

    # AMX tiles against oneDNN (which also multiplies on them), 2-core Xeon with AMX, 2
    # threads: 1,330-1,630 against 980-1,100 GFLOP/s at 64 rows, 1,640-1,760 against
    # 1,435-1,575 at 128, about even at 256, 1,730-1,840 against 2,120-3,210 from 512 on
    TILES_ROWS = 256

    @classmethod
    def native_takes(cls, rows: int) -> bool:
        """Whether the native kernels take a product of `rows` input rows (else torch's)."""
        gemm = quant_cpu.bf16_gemm()
        return (
            rows <= quant_cpu.fused_rows()
            or gemm in ("pairs", "float32")
            or (gemm == "tiles" and rows <= cls.TILES_ROWS)
        )

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"BF16Linear takes a bfloat16 CPU weight, got {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        # streamed whole by every decode step: on huge pages where the OS has them
        self.weight = nn.Parameter(host_memory.copy(weight.contiguous()), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self._bias32 = None if bias is None else bias.detach().float()
        self._rows = float_rows(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)  # [M, K]
        if x.dtype != torch.bfloat16 or not self.native_takes(x2d.shape[0]):
            return F.linear(x, self.weight, self.bias)
        out = quant_cpu.bf16_linear(x2d, self._rows)  # [M, N] float32 sums
        if self._bias32 is not None:
            out += self._bias32
        return out.to(torch.bfloat16).view(*x.shape[:-1], self.out_features)

    @property
    def single_weight(self) -> QuantWeight:
        """The weight as the row kernels read it (a BF16 `QuantWeight`), for the one-call
        decoder layers (pagecli_kernels/layers_cpu.py), which then add `float_bias`."""
        return self._rows

    @property
    def float_bias(self) -> torch.Tensor | None:
        """The bias in float32, as `forward` adds it to the float32 sums before rounding."""
        return self._bias32

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bfloat16"


def use_bf16_rows(module: nn.Module) -> None:
    """Replace every bfloat16 CPU `nn.Linear` below `module` whose columns are whole 32-value
    blocks by a `BF16Linear` over the same weight."""
    for name, child in list(module.named_children()):
        if (
            type(child) is nn.Linear
            and child.weight.dtype == torch.bfloat16
            and child.weight.device.type == "cpu"
            and child.in_features % 32 == 0
        ):
            setattr(module, name, BF16Linear(child.weight.data, child.bias))
        else:
            use_bf16_rows(child)


def native_projection(module: nn.Module) -> tuple | None:
    """A projection as the native ops take it (pagecli_kernels/layer_ops.Linear): (weight
    parts, float32 bias or None, input and output sizes); None when they cannot (a float or
    oneDNN-packed weight)."""
    parts = getattr(module, "native_parts", None)
    if parts is None:
        single = getattr(module, "single_weight", None)
        parts = None if single is None else (single,)
    if parts is None:
        return None
    if isinstance(module, BF16Linear):
        bias = module.float_bias
    else:
        bias = None if module.bias is None else module.bias.data
    return parts, bias, module.in_features, module.out_features
