"""A GGUF file's tensors under transformers' names, quantized ones kept in their blocks.

Tensors in a format of pagecli_kernels/quant_formats.py become `QuantWeight`s over the file's
raw block bytes: views of gguf.GGUFReader's (copy-on-write) memory map, which the quantized
layers copy once into memory of their own, fused where they fuse, so that the map can close
after loading. The values are never dequantized and re-quantized. llama.cpp's permutation of
Q/K rows is undone by permuting whole rows of blocks. Everything else (norms,
F32/F16/BF16 tensors, formats without a kernel) is dequantized to float32 as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagecli_kernels.quant_formats import BY_GGML_TYPE, QuantWeight

Weight = QuantWeight | torch.Tensor


def open_gguf(path: Path):
    """gguf.GGUFReader over the file; GGUFError (with the path) when it cannot be read."""
    import gguf

    from pagecli.loader.gguf_convert import GGUFError

    try:
        return gguf.GGUFReader(str(path), "c")  # copy-on-write: writable views, file untouched
    except Exception as exc:  # the gguf package raises assorted errors for a bad file
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None


def iter_gguf_weights(reader, keep_quantized: bool) -> Iterator[tuple[str, Weight]]:
    """(transformers name, weight) for each model tensor of the file: a `QuantWeight` for a
    2-D tensor in a supported block format when `keep_quantized`, else float32."""
    import gguf

    from pagecli.loader.gguf_convert import (
        ARCHITECTURES,
        PERMUTED_ARCHS,
        GGUFError,
        field,
        hf_tensor_name,
        unpermute_qk,
    )

    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}")
    num_heads = int(field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(field(reader, f"{arch}.attention.head_count_kv", num_heads))
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
            raw = torch.from_numpy(np.asarray(t.data).reshape(rows, -1))  # a view of the map
            if heads is not None:
                order = unpermute_qk(torch.arange(rows).unsqueeze(1), heads).squeeze(1)
                raw = raw[order]  # whole rows of blocks, copied once
            weight: Weight = QuantWeight(fmt, raw, cols)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, [rows, cols]
            weight = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
            if heads is not None:
                weight = unpermute_qk(weight, heads)
            weight = weight.contiguous()
        yield name, weight


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's model tensors as stored (the resident size when kept quantized)."""
    from pagecli.loader.gguf_convert import hf_tensor_name

    reader = open_gguf(path)
    return sum(int(t.n_bytes) for t in reader.tensors if hf_tensor_name(t.name) is not None)
