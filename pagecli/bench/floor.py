"""The single-stream decode floor: the bytes one decode token reads over the machine's read
bandwidth, measured as benchmarks do (the best of several streaming float32 sums over a 1 GiB
buffer, far past any cache, on the engine's thread count)."""

from __future__ import annotations

import time

BANDWIDTH_BYTES = 1 << 30  # 1 GiB


def read_bandwidth(num_threads: int, repeats: int = 5) -> float:
    """Bytes per second of a streaming float32 sum over 1 GiB on `num_threads` threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        buf = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return BANDWIDTH_BYTES / best


def floor_line(report: dict) -> str | None:
    """ "0.36 GB of 3.16 GB read per decode token (a mixture of experts' chosen experts) /
    29.7 GB/s = floor 12.1 ms" for a report with those figures, else None."""
    active, total = report.get("active_weight_bytes"), report.get("weight_bytes")
    if not active or not total:
        return None

    def size(n: float) -> str:
        return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"

    line = f"{size(active)} of {size(total)} of weights read per decode token"
    if report.get("moe"):
        line += " (each MoE layer's chosen experts only)"
    bandwidth = report.get("read_bandwidth_gb_s")
    if bandwidth:
        line += f" / {bandwidth:.1f} GB/s read bandwidth = floor {active / bandwidth / 1e6:.2f} ms"
    return line
