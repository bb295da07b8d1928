"""A GGUF file's tensors under transformers' names, quantized ones kept in their blocks.

Tensors in a format of pagecli_kernels/quant_formats.py become `QuantWeight`s over the file's
raw block bytes: views of the file's (copy-on-write, never written) memory map
(loader/gguf_file.py), which the quantized layers keep as they are. The weights stay in the
page cache of the mapped file, shared with every other process that maps it and never copied
into memory of the process's own; the map lives as long as the last view of it. The values
are never dequantized and re-quantized. llama.cpp's permutation of Q/K rows (each head's
rotary halves interleaved) is kept too: the rotary kernel reads each head's pairs back into
transformers' order (`qk_pairs`), so no rows are copied. Everything else (norms,
F32/F16/BF16 tensors, formats without a kernel) is dequantized to float32 as before; with
`keep_quantized` off (CUDA, `--quantization none`) the Q/K rows are unpermuted then.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagecli.errors import GGUFError
from pagecli.loader.gguf_file import GGUFFile, GGUFFormatError, GGUFTensor, open_gguf_file
from pagecli_kernels.quant_formats import GGUF_KEPT, QuantWeight

Weight = QuantWeight | torch.Tensor


def file_arch(reader, path=None):
    """The file's architecture as pagecli reads it (models/base.GGUFArch); GGUFError naming
    it and the supported ones when no family of pagecli has it."""
    from pagecli.models.registry import gguf_arch, supported_gguf_archs

    name = reader.get("general.architecture")
    arch = gguf_arch(name)
    if arch is None:
        where = f"{path}: " if path is not None else ""
        raise GGUFError(
            f"{where}unsupported GGUF architecture {name!r} "
            f"(supported: {', '.join(supported_gguf_archs())})"
        )
    return arch


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves in Q/K rows."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return w.transpose(1, 2).reshape(rows, *rest)


def open_gguf(path: Path) -> GGUFFile:
    """The process's reader of the file (parsed once); GGUFError (with the path) when it
    cannot be read."""

    try:
        return open_gguf_file(path)
    except (GGUFFormatError, OSError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise GGUFError(f"{path}: not a readable GGUF file ({reason})") from None


def keeps_qk_pairs(reader: GGUFFile, keep_quantized: bool) -> bool:
    """Whether `iter_gguf_weights` hands over Q/K weights (and biases) in llama.cpp's row
    order, each head's rotary halves interleaved: the model must then deinterleave the
    projection's q and k outputs (`DecoderModel.use_qk_pairs`)."""

    return keep_quantized and file_arch(reader).qk_permuted


def iter_gguf_weights(reader: GGUFFile, keep_quantized: bool) -> Iterator[tuple[str, Weight]]:
    """(transformers name, weight) for each model tensor of the file: a `QuantWeight` for a
    2-D tensor in a supported block format when `keep_quantized`, else float32. A
    `QuantWeight` is a view of the file's map that stays valid as long as it is held: keep
    it, never write it. With `keep_quantized`, Q/K tensors of a permuted architecture keep
    the file's row order (`keeps_qk_pairs`); otherwise they are unpermuted."""

    family = file_arch(reader)
    arch = reader.get("general.architecture")
    num_heads = int(reader.get(f"{arch}.attention.head_count"))
    num_kv_heads = int(reader.get(f"{arch}.attention.head_count_kv", num_heads))
    unpermute = not keep_quantized and family.qk_permuted  # else keeps_qk_pairs
    for t, name in model_tensors(reader, family):
        if "{e}" in name and name.endswith(".bias"):  # [E, rows] biases: each expert's row
            stack = tensor_weight(t, keep_quantized=False)
            for e in range(stack.shape[0]):
                yield name.format(e=e), stack[e].clone()
            reader.release(t)
            continue
        if "{e}" in name:  # a 3-D expert stack: each expert's rows
            weights = expert_weights(t, keep_quantized)
            for e, weight in enumerate(weights):
                yield name.format(e=e), weight
            if not isinstance(weights[0], QuantWeight):
                reader.release(t)  # dequantized: the file's pages of it are not needed again
            continue
        heads = None
        if unpermute and ".q_proj." in name:
            heads = num_heads
        elif unpermute and ".k_proj." in name:
            heads = num_kv_heads
        # Gemma's norms are stored as 1 + w: back to transformers' w, as its reader does
        offset = family.norm_offset and "norm.weight" in t.name
        weight = tensor_weight(t, keep_quantized, heads, offset)
        if family.convert is not None and not isinstance(weight, QuantWeight):
            weight = family.convert(name, weight)
        yield name, weight
        if not isinstance(weight, QuantWeight):
            reader.release(t)  # dequantized: the file's pages of it are not needed again


def model_tensors(reader: GGUFFile, family) -> Iterator[tuple[GGUFTensor, str]]:
    """(tensor, transformers name) for the file's tensors of the model pagecli runs: those
    its family names, less the multi-token-prediction layers a converter appends after the
    model's own (`{arch}.nextn_predict_layers` of `{arch}.block_count`; Qwen3.5, GLM). A 3-D
    expert stack comes with its experts' name, "{e}" standing for the expert
    (`expert_weights` cuts it)."""
    arch = reader.get("general.architecture")
    blocks = reader.get(f"{arch}.block_count")
    extra = reader.get(f"{arch}.nextn_predict_layers") or 0
    layers = int(blocks) - int(extra) if blocks is not None else None
    for t in reader.tensors:
        name = family.hf_name(t.name) or family.expert_template(t.name)
        if name is None:
            continue
        if layers is not None and name.startswith("model.layers."):
            if int(name.split(".", 3)[2]) >= layers:
                continue
        yield t, name


def kept_format(t: GGUFTensor):
    """The format a tensor keeps in the map (a block format, or BF16 rows of whole 32-value
    blocks), or None: it loads as float32."""
    fmt = GGUF_KEPT.get(int(t.tensor_type))
    if fmt is not None and int(t.shape[0]) % fmt.block_values:
        return None  # rows the format's kernels cannot cut (bfloat16 of odd widths)
    return fmt


FLOAT_TYPES = (0, 1)  # ggml's F32 and F16: loaded as float32


def check_expert_format(t: GGUFTensor) -> None:
    """GGUFError for a 3-D expert stack in a format pagecli neither keeps in the map nor
    loads as float (F16, F32): expanded to float32, a model's experts would not fit where
    their blocks do."""
    if kept_format(t) is None and int(t.tensor_type) not in FLOAT_TYPES:
        kind = getattr(t.tensor_type, "name", t.tensor_type)
        kept = ", ".join(
            {"bfloat16": "BF16"}.get(f.name, f.name.upper()) for f in GGUF_KEPT.values()
        )
        raise GGUFError(
            f"{t.name}: experts in {kind} are not supported (pagecli keeps experts in {kept}; "
            "F16 and F32 load as float)"
        )


def expert_count(t: GGUFTensor) -> int:
    """The experts of a 3-D expert stack (ggml lists the experts' axis last)."""
    return int(t.shape[-1]) if len(t.shape) == 3 else 0


def expert_weights(t: GGUFTensor, keep_quantized: bool) -> list[Weight]:
    """A 3-D expert stack [E, rows, cols] as E weights [rows, cols]: with `keep_quantized`
    and a supported block format, `QuantWeight` views of each expert's rows of the file's map
    (never copied); else float32 (one dequantization of the stack, cut by experts)."""

    if len(t.shape) != 3:
        raise GGUFError(f"{t.name}: an expert tensor of {len(t.shape)} dimensions, not 3")
    experts, rows, cols = (int(d) for d in reversed(t.shape))
    fmt = kept_format(t)
    if keep_quantized:
        check_expert_format(t)
    if keep_quantized and fmt is not None:
        data = torch.from_numpy(t.data.reshape(experts * rows, -1))  # a view
        return [QuantWeight(fmt, data[e * rows : (e + 1) * rows], cols) for e in range(experts)]
    values = _dequantize(t)
    stack = torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(experts, rows, cols)
    return list(stack.unbind(0))


def _dequantize(t: GGUFTensor):
    """The tensor's values as float32 (numpy), or GGUFError naming a format the gguf
    package cannot read."""
    import gguf

    try:
        return gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError, KeyError):
        kind = getattr(t.tensor_type, "name", t.tensor_type)
        raise GGUFError(f"{t.name}: tensor type {kind} is not supported") from None


def tensor_weight(
    t: GGUFTensor, keep_quantized: bool, heads: int | None = None, offset: bool = False
) -> Weight:
    """One tensor of a GGUF file: a `QuantWeight` view of the map for a 2-D tensor in a
    supported block format when `keep_quantized`, else float32 (its Q/K rows unpermuted for
    `heads` heads when given; 1 subtracted with `offset`)."""

    shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims fastest first
    fmt = kept_format(t)
    if keep_quantized and fmt is not None and len(shape) == 2:
        rows, cols = shape
        return QuantWeight(fmt, torch.from_numpy(t.data.reshape(rows, -1)), cols)  # a view
    data = _dequantize(t)  # float32, [rows, cols]
    weight = torch.from_numpy(np.asarray(data, dtype=np.float32)).reshape(shape)
    if heads is not None:
        weight = unpermute_qk(weight, heads)
    if offset:
        weight = weight - 1
    return weight.contiguous()


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's model tensors as stored (the resident size when kept quantized)."""

    reader = open_gguf(path)
    family = file_arch(reader, path)
    return sum(t.n_bytes for t, _ in model_tensors(reader, family))
