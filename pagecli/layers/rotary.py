"""Rotary position embeddings (rotate-half form), with the RoPE variants of transformers:
scaled types (llama3, linear, yarn, longrope...), per-layer-type parameters (Gemma 3's local
and global layers) and partial rotary (the first R of each head's D values)."""

from __future__ import annotations

import torch
from torch import nn

from pagecli_kernels import fused_cpu

# rope types whose frequencies depend on the sequence length in transformers' own forward
_UNSUPPORTED = {"dynamic": "dynamic NTK RoPE (its frequencies depend on the sequence length)"}


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `config` (of one layer type where they differ per type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def rope_inv_freq(
    config, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ([R / 2]) and attention scaling for `config`'s RoPE (of one layer
    type), computed as transformers' own functions do so that scaled variants match it; R is
    the rotary width (head_dim times partial_rotary_factor)."""
    params = rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", 1.0)
        dim = int(head_dim * factor)
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (base**exponent), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type in _UNSUPPORTED:
        raise ValueError(f"unsupported rope_type {rope_type!r}: {_UNSUPPORTED[rope_type]}")
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return inv_freq.float(), float(scaling)


def long_rope_inv_freq(config, layer_type: str | None = None) -> tuple[torch.Tensor, int] | None:
    """LongRoPE's long-context frequencies and the length past which transformers uses them
    (original_max_position_embeddings), or None for other RoPE types."""
    params = rope_parameters(config, layer_type)
    if params.get("rope_type") != "longrope":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = params.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    if original is None:
        raise ValueError("longrope needs original_max_position_embeddings")
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=original + 1, **kwargs)
    return inv_freq.float(), int(original)


def _table(inv_freq: torch.Tensor, scaling: float, max_position: int):
    positions = torch.arange(max_position, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
    return emb.cos() * scaling, emb.sin() * scaling  # [P, R] float32 each


class RotaryEmbedding(nn.Module):
    """A precomputed cos/sin table for RoPE at every position up to `max_position` (for one
    layer type where the config's RoPE differs per type).

    LongRoPE (Phi-3.5/4-mini) has two tables: transformers rotates a sequence of at most
    original_max_position_embeddings tokens with the short factors and a longer one, every
    token of it, with the long ones (its generate drops the cache when a sequence grows past
    that length). `long_rows` marks, per token, which table it reads (layers/attention.py's
    metadata carries the marks; engine/model_runner.py sets them, and the scheduler restarts
    a sequence that grows past the original context)."""

    def __init__(
        self, config, head_dim: int, max_position: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        # Built on the CPU in float32 even when the model is constructed on the meta device;
        # `to_device` moves the table once the model is materialized.
        with torch.device("cpu"):
            inv_freq, scaling = rope_inv_freq(config, head_dim, layer_type)
            self.rotary_dim = 2 * inv_freq.shape[0]
            if not 2 <= self.rotary_dim <= head_dim:
                raise ValueError(f"rotary width {self.rotary_dim} for head_dim {head_dim}")
            self.cos, self.sin = _table(inv_freq, scaling, max_position)  # [P, R]
            long = long_rope_inv_freq(config, layer_type)
            self.original_max_position: int | None = None
            if long is not None:
                self.original_max_position = long[1]
                cos, sin = _table(long[0], scaling, max_position)
                self.cos, self.sin = torch.cat([self.cos, cos]), torch.cat([self.sin, sin])
        self.max_position = max_position

    def to_device(self, device: torch.device, dtype: torch.dtype) -> None:
        """Place the cos/sin table, cast once to the model's dtype as transformers does."""
        self.cos = self.cos.to(device=device, dtype=dtype)
        self.sin = self.sin.to(device=device, dtype=dtype)

    def forward(
        self, positions: torch.Tensor, long_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, [T, 1, R] each; computed once per forward
        pass and shared by the layers of this table. `long_rows` [T] bool: the tokens that
        take LongRoPE's long table."""
        rows = positions
        if self.original_max_position is not None and long_rows is not None:
            rows = positions + long_rows.to(positions.dtype) * self.max_position
        return self.cos[rows].unsqueeze(1), self.sin[rows].unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D], cos/sin: [T, 1, R] with R <= D (partial rotary: the first
    R values of each head turn, the rest pass). On the CPU q and k are rotated in place by one
    native call (they are views of the step's fresh qkv projection). `pairs`: each head of q
    and k comes in llama.cpp's order, its two rotary halves interleaved ([x0, x_{D/2}, x1,
    x_{D/2+1}, ...]), and is returned in transformers' order (halves), rotated: exactly the
    values of unpermuted weights."""
    if fused_cpu.rotary_supported(q, k) and cos.dtype == q.dtype and cos.is_contiguous():
        fused_cpu.rotary_(q, k, cos.squeeze(1), sin.squeeze(1), pairs=pairs)
        return q, k
    if pairs:
        q, k = pairs_to_halves(q), pairs_to_halves(k)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q = torch.cat([q_rot * cos + _rotate_half(q_rot) * sin, q_pass], dim=-1)
    k = torch.cat([k_rot * cos + _rotate_half(k_rot) * sin, k_pass], dim=-1)
    return q, k


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., D] in llama.cpp's interleaved order -> transformers' order (a copy)."""
    half = x.shape[-1] // 2
    return x.unflatten(-1, (half, 2)).transpose(-1, -2).flatten(-2)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
