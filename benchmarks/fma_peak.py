"""This machine's float32 multiply-add peak, the compute floor beside a prefill figure.

`fma_peak(threads)` is the best of several passes of benchmarks/fma_peak.c (twelve FMA chains
per thread in registers, on the widest vectors the CPU has): what the cores can do at the
clock they run at now, which on a cloud guest is often not the clock it reports. A product
with float32 activations and sums cannot run faster than this on a CPU without matrix tiles
(AMX's bfloat16 tiles take exact parts of float32 values faster: see RESULTS.md).

    .venv/bin/python benchmarks/fma_peak.py [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from pagecli_kernels import native

SOURCE = Path(__file__).with_name("fma_peak.c")


def _library() -> ctypes.CDLL:
    lib = native.build_and_load("fma_peak", [SOURCE], native.FLAGS)
    lib.pagecli_fma_lanes.restype = ctypes.c_int
    lib.pagecli_fma_run.restype = ctypes.c_double
    lib.pagecli_fma_run.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    return lib


def fma_peak(threads: int, passes: int = 5, iters: int = 20_000_000) -> float:
    """FLOP/s: the best of `passes` runs of `iters` rounds of twelve chains per thread."""
    lib = _library()
    lanes = lib.pagecli_fma_lanes()
    sink = ctypes.c_float()
    best = min(lib.pagecli_fma_run(threads, iters, ctypes.byref(sink)) for _ in range(passes))
    return threads * iters * 12 * lanes * 2 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    lanes = _library().pagecli_fma_lanes()
    peak = fma_peak(args.threads)
    print(f"float32 FMA peak, {args.threads} threads, {lanes} lanes: {peak / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
