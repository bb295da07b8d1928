"""Host memory for the weights that the CPU kernels stream every step: transparent huge pages.

A decode step reads every weight once, tens to hundreds of MB in a few milliseconds. On
4 KiB pages that is a TLB miss and a page walk for every 4 KiB read; with 2 MiB pages the
default model's 96 MB are 48 TLB entries (single-stream decode 9% faster, float32 weights
4.5%: benchmarks/RESULTS.md).

Linux backs an anonymous private mapping with huge pages when the range is 2 MiB-aligned and
marked MADV_HUGEPAGE (transparent_hugepage set to `madvise` or `always`). A layer's weights
are far smaller than 2 MiB, so they are carved, 64-byte aligned, out of shared chunks of at
least CHUNK_BYTES; a chunk is unmapped when the last tensor in it is freed (each tensor holds
its chunk's buffer; the chunk still being carved is held here too, so at most one chunk
outlives its tensors). Where the OS has no madvise (or the mapping fails), `empty` returns
ordinary torch memory: the kernels work the same, on small pages.
"""

from __future__ import annotations

import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 32 << 20
ALIGN = 64

_lock = threading.Lock()
_chunk: dict = {"buffer": None, "used": 0}  # the chunk that allocations are carved from


def _new_chunk(nbytes: int) -> torch.Tensor | None:
    """A 2 MiB-aligned uint8 tensor of at least `nbytes`, advised onto huge pages; None if
    this OS cannot."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_PRIVATE"):
        return None
    size = -(-max(nbytes, CHUNK_BYTES) // HUGE_PAGE) * HUGE_PAGE
    try:
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    start = -whole.data_ptr() % HUGE_PAGE  # mmap gives 4 KiB alignment; THP needs 2 MiB
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:  # THP off in this kernel: small pages, still one mapping per chunk
        pass
    return whole[start : start + size]


def empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `nbytes`, 64-byte aligned, on huge pages where the OS
    gives them."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    padded = -(-nbytes // ALIGN) * ALIGN
    with _lock:
        buffer, used = _chunk["buffer"], _chunk["used"]
        if buffer is None or used + padded > buffer.numel():
            buffer = _new_chunk(padded)
            if buffer is None:
                return torch.empty(nbytes, dtype=torch.uint8)
            if padded < CHUNK_BYTES:  # a large request gets a chunk of its own
                _chunk["buffer"], _chunk["used"] = buffer, padded
            return buffer[:nbytes]
        _chunk["used"] = used + padded
        return buffer[used : used + nbytes]


def copy(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous copy of a CPU `tensor` in memory from `empty`, converted to `dtype` on the
    way where one is given (one pass, no temporary)."""
    dtype = tensor.dtype if dtype is None else dtype
    out = empty(tensor.numel() * dtype.itemsize).view(dtype).view(tensor.shape)
    out.copy_(tensor)
    return out


def huge_page_bytes() -> int:
    """Bytes of this process's memory on transparent huge pages (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
