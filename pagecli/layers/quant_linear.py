"""Layers whose weights stay in a GGUF file's block formats (CPU): linear and embedding.

`QuantLinear` computes `y = x @ dequant(W).T + bias` with the C kernels of
pagecli_kernels/quant_cpu.py: float32 activations and sums, the weights read packed (a Q4_1
projection streams 5 bits per weight instead of 32). A fused projection (q/k/v, gate/up)
holds its checkpoint tensors as separate parts, since a file may mix formats (Q4_K_M files
keep some v and down projections in Q6_K) and since each part is used where it lies: a view
of a GGUF file's memory map (loader/gguf_weights.py) is kept, never copied, so the weights
stay in the page cache of the file.

`QuantEmbedding` dequantizes only the looked-up rows, and a tied output projection multiplies
with the same blocks (`as_linear`), so no float copy of the table exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagecli_kernels import layers_cpu, quant_cpu
from pagecli_kernels.quant_formats import QuantWeight

Part = QuantWeight | torch.Tensor  # a float part ([rows, cols]) where the file had F32/F16


class QuantLinear(nn.Module):
    """`y = x @ W.T + bias` with W the parts' rows one after the other (`out_sizes`)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_features = sum(out_sizes)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self._pending: list[Part | None] = [None] * len(out_sizes)
        self.parts: list[Part] = []  # set by finish()
        self._fast: quant_cpu.PreparedLinear | None = None  # one quantized part: the hot path

    def set_part(self, index: int, weight: Part) -> None:
        """Load the weight of output part `index`; checks its shape."""
        expected = (self.out_sizes[index], self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"part {index} has shape {tuple(weight.shape)}, expected {expected}")
        self._pending[index] = weight if isinstance(weight, QuantWeight) else weight.float()
        if all(p is not None for p in self._pending):
            self._finish()

    @property
    def loaded(self) -> list[bool]:
        """Which parts have been set."""
        return [p is not None for p in self._pending]

    def _finish(self) -> None:
        # Kept as they are: block-format parts may be views of a file's map (never written).
        self.parts = list(self._pending)
        single = self.parts[0] if len(self.parts) == 1 else None
        if isinstance(single, QuantWeight) and single.data.device.type == "cpu":
            self._fast = quant_cpu.PreparedLinear(single)
        self._pending = [True] * len(self._pending)  # loaded; the buffers live in parts

    @property
    def single_weight(self) -> QuantWeight | None:
        """The weight when the layer is one block-format CPU buffer (what the one-call decoder
        layers take, with `bias`), else None."""
        return self._fast.weight if self._fast is not None else None

    @property
    def native_parts(self) -> tuple[QuantWeight, ...] | None:
        """The parts when each is a block-format CPU buffer and there are at most
        `layers_cpu.MAX_PARTS` (what the one-call decoder layers take, with `bias`), else
        None."""
        parts = self.parts
        if not 1 <= len(parts) <= layers_cpu.MAX_PARTS or not all(
            isinstance(p, QuantWeight) and p.data.device.type == "cpu" for p in parts
        ):
            return None
        return tuple(parts)

    @property
    def formats(self) -> list[str]:
        """The parts' weight formats ("q4_k", ..., or "float32" for a float part)."""
        return [p.format.name if isinstance(p, QuantWeight) else "float32" for p in self.parts]

    @property
    def nbytes(self) -> int:
        """Bytes of the weights (bias excluded)."""
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self._fast is not None
            and x.dim() == 2
            and x.dtype == torch.float32
            and x.stride(-1) == 1
            and self.bias is None
        ):
            return self._fast(x)  # [M, N]
        dtype = x.dtype
        x2d = x.reshape(-1, self.in_features).float()  # [M, K]
        if len(self.parts) == 1:
            out = _part_linear(x2d, self.parts[0], None)  # [M, N]
        else:
            out = torch.empty(x2d.shape[0], self.out_features)  # [M, N]
            start = 0
            for part in self.parts:
                _part_linear(x2d, part, out[:, start : start + part.shape[0]])
                start += part.shape[0]
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + "+".join(
            self.formats
        )


def _part_linear(x2d: torch.Tensor, part: Part, out: torch.Tensor | None) -> torch.Tensor:
    if isinstance(part, QuantWeight):
        return quant_cpu.quant_linear(x2d, part, out)
    if out is None:
        return F.linear(x2d, part)
    out.copy_(F.linear(x2d, part))
    return out


class QuantEmbedding(nn.Module):
    """A token embedding kept in a block format: lookups dequantize only their rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # the lookups' dtype: the model's, as nn.Embedding would take it
        self.dtype = torch.get_default_dtype() if dtype is None else dtype
        self.weight: QuantWeight | None = None  # set by set_weight()

    def set_weight(self, weight: QuantWeight) -> None:
        """Load the table; checks its shape."""
        if weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding has shape {weight.shape}, "
                f"expected {(self.num_embeddings, self.embedding_dim)}"
            )
        self.weight = weight  # as loaded: may be a view of a file's map (never written)
        self._head = quant_cpu.PreparedLinear(self.weight)

    @property
    def formats(self) -> list[str]:
        return [self.weight.format.name]

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return quant_cpu.dequantize(self.weight, input_ids).to(self.dtype)  # [*ids, H]

    def as_linear(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output projection: hidden [S, H] -> logits [S, V], from the same blocks."""
        hidden = hidden.float()
        if hidden.stride(-1) != 1:
            hidden = hidden.contiguous()
        return self._head(hidden)  # [S, V] float32

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.weight.format.name}"
