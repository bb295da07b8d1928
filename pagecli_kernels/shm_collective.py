"""All-reduce and gather between the tensor-parallel ranks of one host through a shared memory
file (csrc/shm_collective.c): microseconds where gloo's sockets take a millisecond.

Rank 0 creates the file (`create`) before the workers start; every rank maps it
(`ShmCollective`). Every rank must make the same collectives in the same order: each call
carries the next collective number. float32 CPU tensors of at most `slot_floats` values;
callers use gloo for anything else.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from pagecli_kernels import native

_bound: dict = {}


class CollectiveError(RuntimeError):
    """A peer never came (time-out) or the group was aborted (a rank died)."""


def _lib() -> ctypes.CDLL:
    lib = native.library()
    if "lib" not in _bound:
        i64, i32, ptr, f64 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_double
        lib.pagecli_shm_header_bytes.argtypes = [i32]
        lib.pagecli_shm_header_bytes.restype = i64
        lib.pagecli_shm_all_reduce.argtypes = [ptr, i64, i32, i32, i64, ptr, i64, f64]
        lib.pagecli_shm_all_reduce.restype = ctypes.c_int
        lib.pagecli_shm_gather.argtypes = [ptr, i64, i32, i32, i64, ptr, i64, ptr, f64]
        lib.pagecli_shm_gather.restype = ctypes.c_int
        lib.pagecli_shm_abort.argtypes = [ptr, i32]
        lib.pagecli_shm_abort.restype = None
        _bound["lib"] = lib
    return _bound["lib"]


def available() -> bool:
    """Whether the native library (and so these collectives) is there."""
    return native.library() is not None


def file_bytes(size: int, slot_floats: int) -> int:
    return int(_lib().pagecli_shm_header_bytes(size)) + 2 * size * slot_floats * 4


def create(path: str, size: int, slot_floats: int) -> None:
    """Make the (zeroed, sparse) file the ranks will map."""
    with open(path, "wb") as f:
        f.truncate(file_bytes(size, slot_floats))


class ShmCollective:
    """One rank's mapping of the file and its count of collectives."""

    def __init__(self, path: str, rank: int, size: int, slot_floats: int, timeout_s: float) -> None:
        self.rank, self.size, self.slot_floats, self.timeout_s = rank, size, slot_floats, timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, file_bytes(size, slot_floats))
        finally:
            os.close(fd)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._number = 0
        # the all-reduces that the one-call decoder layers made, and their time
        self.num_in_layers = 0
        self.seconds_in_layers = 0.0

    def takes(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and x.is_contiguous()
            and x.numel() <= self.slot_floats
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (`takes(x)` must hold)."""
        self._number += 1
        status = _lib().pagecli_shm_all_reduce(
            self._base, self.slot_floats, self.rank, self.size, self._number,
            x.data_ptr(), x.numel(), self.timeout_s,
        )  # fmt: skip
        self._check(status)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` stacked on rank 0 ([size, *x.shape]); None on the others."""
        self._number += 1
        out = torch.empty(self.size, *x.shape, dtype=torch.float32) if self.rank == 0 else None
        status = _lib().pagecli_shm_gather(
            self._base, self.slot_floats, self.rank, self.size, self._number,
            x.data_ptr(), x.numel(), out.data_ptr() if out is not None else None, self.timeout_s,
        )  # fmt: skip
        self._check(status)
        return out

    def layer_fields(self) -> torch.Tensor:
        """This collective as the one-call decoder layers take it (csrc/layer_program_cpu.c's
        TP_FIELDS: base, slot floats, rank, size, last number, time limit in ms, nanoseconds
        spent); hand the tensor back to `after_layers` once they ran."""
        timeout_ms = int(self.timeout_s * 1000)
        fields = [self._base, self.slot_floats, self.rank, self.size, self._number, timeout_ms]
        return torch.tensor([*fields, 0], dtype=torch.int64)

    def after_layers(self, fields: torch.Tensor) -> None:
        """Take the layers' collectives into account (their numbers and time)."""
        done = int(fields[4]) - self._number
        self._number = int(fields[4])
        self.num_in_layers += done
        self.seconds_in_layers += int(fields[6]) * 1e-9

    def abort(self) -> None:
        """Make every rank's waiting collective end (a rank has died)."""
        _lib().pagecli_shm_abort(self._base, self.size)

    def _check(self, status: int) -> None:
        if status == -1:
            raise CollectiveError(f"a tensor-parallel peer did not come in {self.timeout_s:g} s")
        if status == -2:
            raise CollectiveError("the tensor-parallel group was aborted: a rank is gone")
        if status:
            raise CollectiveError(f"shared-memory collective failed ({status})")
