"""RMSNorm as transformers' families compute it (in float32, then back to the input dtype); on
the CPU one native call (pagecli_kernels/fused_cpu.py), optionally with the residual add
before, over whole rows or over each head of a row (per-head q/k norms).

The families differ only in where the weight meets the rounding, which matters in bfloat16
alone (in float32 the three agree bit for bit):
  "rounded"  weight * round(h)                 Llama, Qwen, Mistral, Phi-3, Granite, SmolLM3
  "offset"   round(h * (1 + w)), in float32     Gemma (weights stored as w, used as 1 + w)
  "float"    round(w * h), in float32           OLMo 2
where h = x * rsqrt(mean(x^2) + eps) in float32.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from pagecli_kernels import fused_cpu

NormStyle = Literal["rounded", "offset", "float"]
NORM_STYLES = ("rounded", "offset", "float")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (`hidden_size` values)."""

    def __init__(self, hidden_size: int, eps: float, style: NormStyle = "rounded") -> None:
        super().__init__()
        if style not in NORM_STYLES:
            raise ValueError(f"unknown norm style {style!r} (known: {', '.join(NORM_STYLES)})")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.style = style
        # "offset" and "float": the float32 factor the kernels multiply by (set by post_load)
        self._scale: torch.Tensor | None = None

    def post_load(self) -> None:
        """Compute the float32 factor of the "offset" (1 + w) and "float" styles, once."""
        if self.style == "offset":
            self._scale = (1.0 + self.weight.detach().float()).contiguous()
        elif self.style == "float":
            self._scale = self.weight.detach().float().contiguous()

    def kernel_weight(self) -> tuple[torch.Tensor, int]:
        """The weight the native kernels multiply by and their weight mode (0: of the
        activations' dtype, after rounding; 1: float32, before rounding)."""
        if self.style == "rounded":
            return self.weight.data, 0
        if self._scale is None:
            self.post_load()
        return self._scale, 1

    def _fused(self, x: torch.Tensor) -> bool:
        weight, mode = self.kernel_weight()
        return (
            x.dim() in (2, 3)
            and x.stride(-1) == 1
            and (x.dim() == 2 or x.stride(-2) == x.shape[-1])
            and weight.dtype == (x.dtype if mode == 0 else torch.float32)
            and weight.is_contiguous()
            and fused_cpu.available(x)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, W] rows, or [N, heads, W] (each head normed on its own: q/k norms)."""
        if self._fused(x):
            weight, mode = self.kernel_weight()
            return fused_cpu.rms_norm(x, weight, self.eps, weight_mode=mode)
        return self._torch_forward(x)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """`x += delta` in place (a residual add), then the norm of the sum: [N, H]."""
        if x.dim() == 2 and self._fused(x) and self._fused(delta):
            weight, mode = self.kernel_weight()
            return fused_cpu.rms_norm(x, weight, self.eps, residual_delta=delta, weight_mode=mode)
        x.add_(delta)
        return self._torch_forward(x)

    def _torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style == "rounded":
            return self.weight * h.to(dtype)
        if self.style == "offset":
            return (h * (1.0 + self.weight.float())).to(dtype)
        return (self.weight * h).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, {self.style}"
