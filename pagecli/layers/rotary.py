"""Rotary position embeddings (rotate-half form), with the RoPE variants of transformers."""

from __future__ import annotations

import torch
from torch import nn

from pagecli_kernels import fused_cpu


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for `config`'s RoPE type, computed by
    transformers' own functions so that scaled variants (llama3, linear, yarn...) match it."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE is not supported (it depends on the sequence length)")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table for RoPE at every position up to `max_position`."""

    def __init__(self, config, head_dim: int, max_position: int) -> None:
        super().__init__()
        # Built on the CPU in float32 even when the model is constructed on the meta device;
        # `to_device` moves the table once the model is materialized.
        with torch.device("cpu"):
            inv_freq, scaling = rope_inv_freq(config, head_dim)
            positions = torch.arange(max_position, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            self.cos = emb.cos() * scaling  # [P, D] float32
            self.sin = emb.sin() * scaling

    def to_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Place the cos/sin table, cast once to the model's dtype as transformers does."""
        self.cos = self.cos.to(device=device, dtype=dtype)
        self.sin = self.sin.to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, [T, 1, D] each; computed once per forward
        pass and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, 1, D]. On the CPU q and k are rotated in
    place by one native call (they are views of the step's fresh qkv projection).
    `pairs`: each head of q and k comes in llama.cpp's order, its two rotary halves
    interleaved ([x0, x_{D/2}, x1, x_{D/2+1}, ...]), and is returned in transformers' order
    (halves), rotated: exactly the values of unpermuted weights."""
    if fused_cpu.rotary_supported(q, k) and cos.dtype == q.dtype and cos.is_contiguous():
        fused_cpu.rotary_(q, k, cos.squeeze(1), sin.squeeze(1), pairs=pairs)
        return q, k
    if pairs:
        q, k = pairs_to_halves(q), pairs_to_halves(k)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., D] in llama.cpp's interleaved order -> transformers' order (a copy)."""
    half = x.shape[-1] // 2
    return x.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
