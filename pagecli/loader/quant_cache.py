"""Load-time quantization of a float safetensors checkpoint, once: the result is a GGUF file
under the cache directory that later starts map directly.

`--quantization q4_k|q8_0` on a float16/bfloat16/float32 checkpoint:

- The first start streams the checkpoint tensor by tensor: each tensor is read with plain
  reads into memory of its own (not through safetensors' memory map, whose touched pages
  would count in the process's RSS until the whole shard is closed: 10 GB for a 7B shard),
  quantized by the native kernel (loader/quantize.py) and appended to the cache file, then
  freed. The peak is about one tensor in float32 beside its blocks, whatever the model's size.
- The cache file is a GGUF (the gguf package's writer): the quantized projections and the
  token embedding in their blocks, every other tensor (norms, biases) in float32, under
  transformers' names. It is written to a temporary name and renamed when complete, so a
  killed first start leaves no half file behind; the next start quantizes again.
- Every start, the first included, then loads from the cache file's memory map, so the first
  and the second start run the same bytes, read in place (loader/gguf_weights.py).

The key names the checkpoint's files (name, size, mtime), the mode and CACHE_VERSION: a
changed checkpoint or a changed quantizer gets a new file. Progress goes to stderr.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagecli.loader.resolve import ModelLoadError, ModelSource, cache_root
from pagecli.loader.weights import (
    SAFETENSORS_DTYPES,
    checkpoint_names,
    checkpoint_split,
    split_shape,
)

# bump when the quantizer's output, the file's layout or what it quantizes changes
CACHE_VERSION = 2


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes are, and what they are."""

    file: Path
    name: str
    dtype: str  # safetensors' name: F16, BF16, F32
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    end: int


def stored_tensors(folder: Path, name: str) -> list[StoredTensor]:
    """Every tensor of the folder's *.safetensors files, from their headers alone (the
    format: an 8-byte little-endian header length, a JSON header, the data)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{name}: no *.safetensors weights in {folder}")

    rename = checkpoint_names(folder)
    found = []
    for file in files:
        try:
            with open(file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 << 20:
                    raise ValueError(f"a header of {length} bytes")
                header = json.loads(f.read(length))
            size = file.stat().st_size
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if rename is not None and rename(key) is None:
                    continue  # not the language model's
                start, end = (8 + length + int(o) for o in entry["data_offsets"])
                if not 8 + length <= start <= end <= size:
                    raise ValueError(f"{key}: data offsets past the end of the file")
                key = key if rename is None else rename(key)
                found.append(
                    StoredTensor(file, key, entry["dtype"], tuple(entry["shape"]), start, end)
                )
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            raise ModelLoadError(f"{file}: corrupt safetensors file ({exc})") from None
    return found


def read_tensor(t: StoredTensor, raw: bool = False) -> torch.Tensor:
    """The tensor's values in memory of their own, read (not mapped) from its file; `raw`:
    bytes too (U8: blocks a family's cut repacks)."""
    dtype = SAFETENSORS_DTYPES.get(t.dtype)
    if dtype is None or (dtype == torch.uint8 and not raw):
        raise ModelLoadError(f"{t.file}: {t.name} is {t.dtype}; quantizing takes F16, BF16, F32")
    out = torch.empty(t.shape, dtype=dtype)
    view = out.view(-1).view(torch.uint8).numpy()
    if view.nbytes != t.end - t.start:
        raise ModelLoadError(f"{t.file}: {t.name} has {t.end - t.start} bytes for {t.shape}")
    with open(t.file, "rb", buffering=0) as f:
        f.seek(t.start)
        done = 0
        while done < view.nbytes:
            got = f.readinto(memoryview(view)[done:])
            if not got:
                raise ModelLoadError(f"{t.file}: truncated at {t.name}")
            done += got
        if hasattr(os, "posix_fadvise"):  # read once: leave the page cache to the weights
            os.posix_fadvise(f.fileno(), t.start, t.end - t.start, os.POSIX_FADV_DONTNEED)
    return out


def cache_path(source: ModelSource, mode: str) -> Path:
    """The cache file of `source` quantized in `mode`."""
    files = sorted(source.path.glob("*.safetensors"))
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = json.dumps([CACHE_VERSION, mode, str(source.path.resolve()), stats])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", source.name).strip("-.") or "model"
    return cache_root() / "quantized" / f"{stem}.{mode}.{digest}.gguf"


@dataclass(frozen=True)
class Piece:
    """One tensor of the cache: a stored tensor, or one of those its family cuts it into
    (loader/weights.checkpoint_split), and the block format it takes (None: float32);
    `kept`: blocks the cut made (gpt-oss's MXFP4 experts), written as they are."""

    name: str
    shape: tuple[int, ...]
    fmt: str | None
    kept: bool = False


def _plan(tensors: list[StoredTensor], mode: str, split) -> list[tuple[StoredTensor, list[Piece]]]:
    """Each stored tensor with the cache's tensors made of it (none for one whose cut waits
    for a later tensor: that one's pieces hold both)."""
    from pagecli.loader.quantize import wants_quantization, weight_format

    def piece(name: str, shape: tuple[int, ...], kept: str | None) -> Piece:
        if kept is not None:
            return Piece(name, shape, kept, kept=True)
        quantize = wants_quantization(name, len(shape))
        return Piece(name, shape, weight_format(name, shape[1], mode) if quantize else None)

    def dtype(t: StoredTensor) -> torch.dtype:
        return SAFETENSORS_DTYPES.get(t.dtype, torch.float32)

    return [
        (t, [piece(*p) for p in split_shape(split, t.name, t.shape, dtype(t))]) for t in tensors
    ]


def write_cache(source: ModelSource, mode: str, path: Path) -> None:
    """Quantize the checkpoint tensor by tensor into the GGUF file `path`."""
    import gguf

    from pagecli.loader.quantize import quantize_weight
    from pagecli_kernels.quant_formats import FORMATS

    plan = _plan(stored_tensors(source.path, source.name), mode, checkpoint_split(source.path))
    split = checkpoint_split(source.path)  # a fresh one for the pass that writes
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), "pagecli-quantized")
    writer.add_string("pagecli.source", str(source.path))
    writer.add_string("pagecli.quantization", mode)
    writer.add_uint32("pagecli.cache_version", CACHE_VERSION)
    for p in (p for _, pieces in plan for p in pieces):
        numel = int(np.prod(p.shape)) if p.shape else 1
        if p.fmt is None:
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), numel * 4)
            continue
        f = FORMATS[p.fmt]
        rows, cols = p.shape
        if cols % f.block_values:
            raise ModelLoadError(f"{p.name}: {cols} columns are not whole {p.fmt} blocks")
        row_bytes = cols // f.block_values * f.block_bytes
        qtype = gguf.GGMLQuantizationType(f.ggml_type)
        writer.add_tensor_info(
            p.name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, qtype
        )
    total = sum(t.end - t.start for t, _ in plan)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with _progress(f"quantizing {source.name} to {mode}", total) as advance:
            for t, pieces in plan:
                tensor = read_tensor(t, raw=split is not None and split.takes(t.name))
                cut = [(t.name, tensor)] if split is None or not split.takes(t.name) else None
                for p, (_, part) in zip(pieces, cut or split.cut(t.name, tensor), strict=True):
                    if p.kept:
                        data = part.data.numpy()
                    elif p.fmt is None:
                        data = part.float().contiguous().numpy()
                    else:
                        data = quantize_weight(p.name, part.contiguous(), mode).data.numpy()
                    writer.write_tensor_data(data)
                del tensor, cut
                advance(t.end - t.start)
        writer.close()
        os.replace(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise


def ensure_cache(source: ModelSource, mode: str) -> Path:
    """The cache file of `source` in `mode`, written first if there is none."""
    path = cache_path(source, mode)
    if not path.exists():
        write_cache(source, mode, path)
    return path


def iter_cached(path: Path) -> Iterator[tuple[str, object]]:
    """(name, weight) from a cache file: `QuantWeight` views of its map for the blocks,
    float32 tensors for the rest (the loader copies those into the parameters)."""
    from pagecli.loader.gguf_file import open_gguf_file
    from pagecli.loader.gguf_weights import tensor_weight

    reader = open_gguf_file(path)
    try:
        reader.advise_huge_pages()
        for t in reader.tensors:
            yield t.name, tensor_weight(t, keep_quantized=True)
    finally:
        reader.close()


class _progress:
    """A Rich bar on stderr while quantizing (a line at the start and the end when stderr is
    not a terminal); the context value advances it by bytes of the checkpoint."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total = what, total

    def __enter__(self) -> Callable[[int], None]:
        import time

        self.start = time.perf_counter()
        gb = self.total / 1e9
        print(f"pagecli: {self.what} ({gb:.1f} GB, once; later starts map the result)",
              file=sys.stderr, flush=True)  # fmt: skip
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

            self.bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("quantizing", total=self.total)
        return self._advance

    def _advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, nbytes)

    def __exit__(self, exc_type, *rest) -> None:
        import time

        if self.bar is not None:
            self.bar.stop()
        if exc_type is None:
            seconds = time.perf_counter() - self.start
            print(f"pagecli: quantized in {seconds:.0f} s", file=sys.stderr, flush=True)
