"""RMSNorm, computed as transformers does (in float32, then back to the input dtype); on the
CPU one native call (pagecli_kernels/fused_cpu.py), optionally with the residual add before."""

from __future__ import annotations

import torch
from torch import nn

from pagecli_kernels import fused_cpu


def _fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.stride(-1) == 1
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and fused_cpu.available(x)
    )


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x, self.weight):
            return fused_cpu.rms_norm(x, self.weight, self.eps)
        return self._torch_forward(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`x += delta` in place (a residual add), then the norm of the sum: [N, H]."""
        if _fused(x, self.weight) and _fused(delta, self.weight):
            return fused_cpu.rms_norm(x, self.weight, self.eps, residual_delta=delta)
        x.add_(delta)
        return self._torch_forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
