"""Linear layers with their weights packed once for oneDNN, for the CPU.

A plain `F.linear` on the CPU hands the weight to MKL's GEMM, which repacks it into its
blocked layout on every call. For a prefill of thousands of tokens that cost disappears under
the arithmetic; for a decode step of a few dozen tokens it does not: the weights are streamed
from memory once to pack and again to multiply, and small decode batches ran at half the
memory bandwidth. Packing each weight once at load time into oneDNN's blocked layout (the
format oneDNN picks for a batch of `BATCH_HINT` rows; it serves any batch size) roughly
halves the time of decode-sized products here (see benchmarks/RESULTS.md).

With the native CPU library, float32 projections without a bias take its kernels instead
(`LlamaForCausalLM.pack_weights`, pagecli_kernels/quant_formats.F32); packing serves the rest.

The packed forward is the same product with a different summation order, so results differ
from `F.linear` by float32 rounding only (`tests/unit/test_linear.py` bounds it).
"""

from __future__ import annotations

import torch
from torch import nn

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
