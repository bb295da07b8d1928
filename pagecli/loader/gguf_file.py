"""A GGUF file read once from one memory map: its metadata, tensor table and tensor data.

gguf.GGUFReader builds several numpy views per metadata item, one per vocabulary entry and
merge (about 300k objects for a 49k vocabulary: seconds per open). Here the header is walked
with `struct` over the map: scalars become Python values, numeric arrays one numpy array each,
and string arrays (tokens, merges) are only skipped over until asked for, then decoded in one
pass. The value and tensor types, and the block sizes, are the `gguf` package's constants.

`open_gguf_file` keeps one `GGUFFile` per file in the process, so the tokenizer conversion, the
weight plan and the weight loader share one parse and one map. Tensor data are views of the
copy-on-write map (writable, the file untouched); `close` drops the map once the weights are
loaded (views still alive keep it until they go).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from pagecli.errors import GGUFFormatError

_SUPPORTED_VERSIONS = (2, 3)
# Fixed-size value types: struct format (little-endian) and numpy dtype.
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}
# Tensor types GGUFReader exposes as values (the rest as raw bytes, one row per ggml row).
_VALUE_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U64 = struct.Struct("<Q")
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays: no model key has any


@dataclass(frozen=True)
class _StringArray:
    """Where a metadata array of strings lies in the map: decoded only when asked for."""

    start: int  # the first element's length field
    end: int
    count: int


@dataclass(frozen=True, eq=False)  # eq=False: `shape` is an array, and entries are unique
class GGUFTensor:
    """One tensor's entry in the table; `data` is a view of the map, as GGUFReader gives it
    (values for F32/F16/..., else uint8 rows of blocks: [rows..., bytes per row])."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # ggml order: fastest-moving dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    file: GGUFFile

    @property
    def data(self) -> np.ndarray:
        region = self.file.map[self.data_offset : self.data_offset + self.n_bytes]
        dims = tuple(int(d) for d in reversed(self.shape))
        dtype = _VALUE_DTYPES.get(self.tensor_type)
        if dtype is not None:
            return region.view(dtype).reshape(dims)
        block_size, type_size = GGML_QUANT_SIZES[self.tensor_type]
        return region.reshape(*dims[:-1], dims[-1] // block_size * type_size)


class GGUFFile:
    """A GGUF file's metadata (`get`, `keys`) and tensors (`tensors`), parsed once."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._map: np.ndarray | None = None
        self._mmap: mmap.mmap | None = None
        self._values: dict[str, Any] = {}
        self._lock = threading.Lock()
        try:
            self._parse(self.map)
        except (
            struct.error,
            IndexError,
            UnicodeDecodeError,
            KeyError,
            ValueError,
            OverflowError,  # a count or length past what an offset can be
            RecursionError,
        ) as exc:
            if isinstance(exc, GGUFFormatError):
                raise
            raise GGUFFormatError(f"truncated or corrupt header ({type(exc).__name__})") from None
        self._release(0, self.data_offset)  # the header (MBs of vocabulary) is parsed

    # ---- the map ---------------------------------------------------------------------------

    @property
    def map(self) -> np.ndarray:
        """The whole file as uint8, mapped copy-on-write (opened again after `close`)."""
        with self._lock:
            if self._map is None:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size == 0:
                        raise GGUFFormatError("empty file")
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                self._map = np.frombuffer(self._mmap, dtype=np.uint8)  # writable: a private map
            return self._map

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's memory once it has been copied: they
        stop counting in its RSS, and a later read maps them from the file again (the map
        is never written, so nothing is lost)."""
        self._release(tensor.data_offset, tensor.data_offset + tensor.n_bytes)

    def _release(self, start: int, end: int) -> None:
        mm = self._mmap
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-start // page) * page  # whole pages inside the range only
        end = end // page * page
        if end > start:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def advise_huge_pages(self) -> None:
        """Ask the kernel to map the tensor data with 2 MiB pages (Linux's file THP, where the
        file system keeps large folios in the page cache): the kernels stream every weight
        once a step, and on 4 KiB pages each 4 KiB read is a TLB miss. A hint only."""
        mm = self._mmap
        if mm is None or not hasattr(mmap, "MADV_HUGEPAGE"):
            return
        page = mmap.PAGESIZE
        start = self.data_offset // page * page
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, start, len(mm) - start)
        except OSError:  # THP off, or not for this file system: small pages, the same bytes
            pass

    def close(self) -> None:
        """Drop this reader's reference to the map (and forget it in the process cache)."""
        with self._lock:
            self._map = self._mmap = None  # unmapped when the last view of it goes
        with _CACHE_LOCK:
            for key, cached in list(_CACHE.items()):
                if cached is self:
                    del _CACHE[key]

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- metadata --------------------------------------------------------------------------

    def keys(self) -> list[str]:
        """The metadata keys, in the file's order."""
        return list(self._values)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value: int/float/bool/str, a numpy array for numeric arrays, a list of
        str for string arrays (decoded on first access), or `default`."""
        value = self._values.get(key, default)
        if isinstance(value, _StringArray):
            value = self._decode_strings(value)
            self._values[key] = value
        return value

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def _decode_strings(self, span: _StringArray) -> list[str]:
        raw = bytes(self.map[span.start : span.end])  # one copy; the loop slices it
        values, pos, unpack = [], 0, _U64.unpack_from
        for _ in range(span.count):
            (length,) = unpack(raw, pos)
            pos += 8
            try:
                values.append(raw[pos : pos + length].decode("utf-8"))
            except UnicodeDecodeError:
                raise GGUFFormatError(f"a string array holds invalid UTF-8 at {pos}") from None
            pos += length
        return values

    # ---- parsing ---------------------------------------------------------------------------

    def _parse(self, blob: np.ndarray) -> None:
        buf = memoryview(blob)  # struct reads straight from the map
        if len(buf) < 24:
            raise GGUFFormatError("too short for a GGUF header")
        (magic,) = struct.unpack_from("<I", buf, 0)
        if magic != GGUF_MAGIC:
            raise GGUFFormatError("no GGUF magic")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:
            raise GGUFFormatError("a big-endian GGUF file (not supported)")
        if version not in _SUPPORTED_VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (supported: 2, 3)")
        self.version = version
        num_tensors, num_kv = struct.unpack_from("<QQ", buf, 8)
        pos = 24
        for _ in range(num_kv):
            key, pos = _read_str(buf, pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            self._values[key], pos = self._read_value(buf, pos + 4, value_type)
        entries = []
        names = set()
        for _ in range(num_tensors):
            name, pos = _read_str(buf, pos)
            (num_dims,) = struct.unpack_from("<I", buf, pos)
            if num_dims > _MAX_DIMS:
                raise GGUFFormatError(f"tensor {name!r} has {num_dims} dimensions")
            dims = np.frombuffer(buf, dtype="<u8", count=num_dims, offset=pos + 4).copy()
            pos += 4 + 8 * num_dims
            raw_type, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if name in names:
                raise GGUFFormatError(f"duplicated tensor {name!r}")
            names.add(name)
            entries.append((name, dims, raw_type, offset))
        alignment = self._values.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"invalid general.alignment {alignment!r}")
        self.alignment = alignment
        self.data_offset = -(-pos // alignment) * alignment
        self.tensors = [self._tensor(*entry) for entry in entries]

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, offset: int) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFFormatError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
        n_elements = math.prod(int(d) for d in dims)  # Python ints: no silent wrap-around
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if len(dims) and int(dims[0]) % block_size:
            raise GGUFFormatError(f"tensor {name!r}: rows of {dims[0]} values, not whole blocks")
        n_bytes = n_elements * type_size // block_size
        start = self.data_offset + int(offset)
        if start + n_bytes > len(self.map):
            raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
        return GGUFTensor(name, tensor_type, dims, n_elements, n_bytes, start, self)

    def _read_value(
        self, buf: memoryview, pos: int, value_type: int, depth: int = 0
    ) -> tuple[Any, int]:
        if value_type in _SCALARS:
            fmt, dtype = _SCALARS[value_type]
            (value,) = struct.unpack_from(fmt, buf, pos)
            return value, pos + dtype.itemsize
        if value_type == GGUFValueType.STRING:
            return _read_str(buf, pos)
        if value_type != GGUFValueType.ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {value_type}")
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _SCALARS:
            dtype = _SCALARS[item_type][1]
            if count * dtype.itemsize > len(buf) - pos:
                raise GGUFFormatError("an array runs past the end of the file")
            values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).copy()
            return values, pos + count * dtype.itemsize
        if item_type == GGUFValueType.STRING:
            start, unpack = pos, _U64.unpack_from
            for _ in range(count):  # lengths only: the strings stay in the map
                pos += 8 + unpack(buf, pos)[0]
                if pos > len(buf):
                    raise GGUFFormatError("a string array runs past the end of the file")
            return _StringArray(start, pos, count), pos
        if item_type == GGUFValueType.ARRAY:  # nested arrays (no model key uses them): eager
            if depth >= _MAX_NESTING:
                raise GGUFFormatError(f"arrays nested more than {_MAX_NESTING} deep")
            items = []
            for _ in range(count):
                if pos > len(buf):
                    raise GGUFFormatError("an array runs past the end of the file")
                value, pos = self._read_value(buf, pos, GGUFValueType.ARRAY, depth + 1)
                items.append(
                    self._decode_strings(value) if isinstance(value, _StringArray) else value
                )
            return items, pos
        raise GGUFFormatError(f"unknown metadata array item type {item_type}")


def _read_str(buf: memoryview, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    pos += 8
    if pos + length > len(buf):
        raise GGUFFormatError("a string runs past the end of the file")
    return bytes(buf[pos : pos + length]).decode("utf-8"), pos + length


_CACHE: dict[tuple[str, int, int], GGUFFile] = {}
_CACHE_LOCK = threading.Lock()


def open_gguf_file(path: Path) -> GGUFFile:
    """The process's `GGUFFile` for `path` (parsed on first use, again when the file changed).
    GGUFFormatError or OSError when it cannot be read."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    reader = GGUFFile(path)
    with _CACHE_LOCK:
        return _CACHE.setdefault(key, reader)
