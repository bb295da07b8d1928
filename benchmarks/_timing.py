"""Timing helper shared by the benchmark scripts in this folder."""

from __future__ import annotations

import statistics
import time


def median_ms(fn, repeats: int) -> float:
    """Median wall time of `fn()` in milliseconds over `repeats` calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
