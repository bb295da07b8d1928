"""GGUF block formats kept as they are in memory: `QuantWeight` and the formats' sizes.

A `QuantWeight` is a `[rows, cols]` matrix stored as `rows` rows of raw GGUF blocks (ggml's
layout, `csrc/quant_blocks.h`): a row is `cols / block_values` blocks, so whole rows can be
selected, permuted and concatenated without touching the values. The kernels are in
`quant_cpu.py`; `reference.py` has their float64 twins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagecli_kernels import host_memory


@dataclass(frozen=True)
class QuantFormat:
    """One block format: ggml's type id, values and bytes per block."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value, also the C kernels' id
    block_values: int
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_values


FORMATS = {
    f.name: f
    for f in (
        QuantFormat("q8_0", 8, 32, 34),
        QuantFormat("q4_0", 2, 32, 18),
        QuantFormat("q4_1", 3, 32, 20),
        QuantFormat("iq4_nl", 20, 32, 18),
        QuantFormat("mxfp4", 39, 32, 17),
        QuantFormat("iq4_xs", 23, 256, 136),
        QuantFormat("q5_0", 6, 32, 22),
        QuantFormat("q5_1", 7, 32, 24),
        QuantFormat("q4_k", 12, 256, 144),
        QuantFormat("q5_k", 13, 256, 176),
        QuantFormat("q6_k", 14, 256, 210),
    )
}
BY_GGML_TYPE = {f.ggml_type: f for f in FORMATS.values()}
# float32 rows taken as 32-value "blocks" of 128 bytes (csrc/quant_f32.c): float weights then
# run the same CPU kernels and one-call layers as block formats. Not a GGUF block format (not
# in FORMATS): a file's F32 tensors load as plain float tensors.
F32 = QuantFormat("float32", 0, 32, 128)
# bfloat16 rows the same way (csrc/quant_bf16.c, 64-byte "blocks"): a bfloat16 model's decode
# products on the CPU. Not in FORMATS either.
BF16 = QuantFormat("bfloat16", 30, 32, 64)
_ROW_FORMATS = {torch.float32: F32, torch.bfloat16: BF16}
# the GGUF tensor types kept as they are in the file's map: the block formats, and BF16
# tensors as bfloat16 rows (ggml's type 30 is BF16's id; rows of whole 32-value blocks)
GGUF_KEPT = {**BY_GGML_TYPE, BF16.ggml_type: BF16}


@dataclass(frozen=True)
class QuantWeight:
    """A `[rows, cols]` weight in one block format; `data` is `[rows, row_bytes]` uint8."""

    format: QuantFormat
    data: torch.Tensor  # [rows, cols / block_values * block_bytes] uint8, contiguous
    cols: int

    def __post_init__(self) -> None:
        f = self.format
        if self.cols % f.block_values:
            raise ValueError(f"{f.name}: {self.cols} columns are not whole {f.block_values}-blocks")
        row_bytes = self.cols // f.block_values * f.block_bytes
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"{f.name}: data must be a 2-D uint8 tensor, got {self.data.dtype}")
        if self.data.shape[1] != row_bytes or not self.data.is_contiguous():
            raise ValueError(
                f"{f.name}: rows of {self.cols} values take {row_bytes} contiguous bytes, "
                f"got data of shape {tuple(self.data.shape)}"
            )

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def select_rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows `index` (a permutation or subset), copied."""
        return QuantWeight(self.format, self.data[index].contiguous(), self.cols)


def float_rows(weight: torch.Tensor) -> QuantWeight:
    """A contiguous float32 or bfloat16 `[rows, cols]` matrix as an F32 or BF16 `QuantWeight`:
    a view of the same memory, no copy (cols a multiple of 32)."""
    fmt = _ROW_FORMATS.get(weight.dtype)
    if fmt is None or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"float_rows takes a contiguous 2-D float32 or bfloat16 tensor, got {weight.dtype}"
        )
    rows, cols = weight.shape
    size = weight.element_size()
    return QuantWeight(fmt, weight.view(torch.uint8).view(rows, cols * size), cols)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Rows of `parts` (one format, same columns) one after the other, in one buffer."""
    first = parts[0]
    if any(p.format != first.format or p.cols != first.cols for p in parts):
        raise ValueError("concat_rows needs one format and one column count")
    if len(parts) == 1:
        return first
    datas = [p.data for p in parts]
    if all(d.device.type == "cpu" for d in datas):  # streamed every step: on huge pages
        shape = (sum(d.shape[0] for d in datas), datas[0].shape[1])
        out = host_memory.empty(shape[0] * shape[1]).view(shape)
        return QuantWeight(first.format, torch.cat(datas, out=out), first.cols)
    return QuantWeight(first.format, torch.cat(datas), first.cols)
