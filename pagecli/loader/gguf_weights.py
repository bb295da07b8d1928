"""A GGUF file's tensors under transformers' names, quantized ones kept in their blocks.

Tensors in a format of pagecli_kernels/quant_formats.py become `QuantWeight`s over the file's
raw block bytes: views of the file's (copy-on-write) memory map (loader/gguf_file.py), which
the quantized layers copy once into memory of their own, fused where they fuse; each tensor's
pages leave the process's memory once it is loaded, and the map closes after loading. The
values are never dequantized and re-quantized. llama.cpp's permutation of Q/K rows is undone
by permuting whole rows of blocks. Everything else (norms, F32/F16/BF16 tensors, formats
without a kernel) is dequantized to float32 as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagecli.loader.gguf_file import GGUFFile, GGUFFormatError, open_gguf_file
from pagecli_kernels.quant_formats import BY_GGML_TYPE, QuantWeight

Weight = QuantWeight | torch.Tensor


def open_gguf(path: Path) -> GGUFFile:
    """The process's reader of the file (parsed once); GGUFError (with the path) when it
    cannot be read."""
    from pagecli.loader.gguf_convert import GGUFError

    try:
        return open_gguf_file(path)
    except (GGUFFormatError, OSError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise GGUFError(f"{path}: not a readable GGUF file ({reason})") from None


def iter_gguf_weights(reader: GGUFFile, keep_quantized: bool) -> Iterator[tuple[str, Weight]]:
    """(transformers name, weight) for each model tensor of the file: a `QuantWeight` for a
    2-D tensor in a supported block format when `keep_quantized`, else float32. A weight may
    be a view of the file's map, valid only until the next item (its pages are then
    released, which would also drop any write to them): copy it, never write it."""
    import gguf

    from pagecli.loader.gguf_convert import (
        ARCHITECTURES,
        PERMUTED_ARCHS,
        GGUFError,
        hf_tensor_name,
        unpermute_qk,
    )

    arch = reader.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}")
    num_heads = int(reader.get(f"{arch}.attention.head_count"))
    num_kv_heads = int(reader.get(f"{arch}.attention.head_count_kv", num_heads))
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        heads = None
        if arch in PERMUTED_ARCHS and ".q_proj." in name:
            heads = num_heads
        elif arch in PERMUTED_ARCHS and ".k_proj." in name:
            heads = num_kv_heads
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims fastest first
        fmt = BY_GGML_TYPE.get(int(t.tensor_type))
        if keep_quantized and fmt is not None and len(shape) == 2:
            rows, cols = shape
            raw = torch.from_numpy(t.data.reshape(rows, -1))  # a view of the map
            if heads is not None:
                order = unpermute_qk(torch.arange(rows).unsqueeze(1), heads).squeeze(1)
                raw = raw[order]  # whole rows of blocks, copied once
            weight: Weight = QuantWeight(fmt, raw, cols)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, [rows, cols]
            weight = torch.from_numpy(np.asarray(data, dtype=np.float32)).reshape(shape)
            if heads is not None:
                weight = unpermute_qk(weight, heads)
            weight = weight.contiguous()
        yield name, weight
        reader.release(t)  # the loader has its copy (or re-reads the pages if it still waits)


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's model tensors as stored (the resident size when kept quantized)."""
    from pagecli.loader.gguf_convert import hf_tensor_name

    return sum(t.n_bytes for t in open_gguf(path).tensors if hf_tensor_name(t.name) is not None)
