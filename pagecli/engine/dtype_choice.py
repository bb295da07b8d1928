"""What `--dtype auto` means on this machine, and why: the dtype and a one-line reason.

On CUDA, bfloat16. On the CPU, bfloat16 only where the CPU multiplies it natively (AMX or
AVX512_BF16 in its flags) and a short matmul probe confirms that bfloat16 runs faster than
float32 here; float32 elsewhere (on AVX2-only CPUs torch's bfloat16 matmuls are several times
slower than float32). The probe takes well under a second and its verdict is cached per
machine (CPU model and flags, torch version, thread count) under the user cache dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagecli.engine.cpu_threads import cpu_model

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names
# bfloat16 must beat float32 by this factor in the probe: at about parity, float32 is exact.
MIN_PROBE_SPEEDUP = 1.2
PROBE_SHAPE = (64, 1024, 1024)  # rows x inner x columns: a decode batch through one layer
PROBE_BUDGET_S = 0.25  # per dtype


@dataclass(frozen=True)
class DTypeChoice:
    """The dtype the engine runs in and why (shown by the chat banner, toolbar and bench)."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        """The dtype as written on the command line ("bfloat16")."""
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _median_s(fn, budget_s: float) -> float:
    fn()  # warm-up: oneDNN picks and caches its kernel
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def probe_bf16_speedup(shape: tuple[int, int, int] = PROBE_SHAPE) -> float:
    """float32 matmul time over bfloat16's on `shape` (> 1: bfloat16 is faster here)."""
    rows, inner, cols = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=gen)  # [rows, inner]
    b = torch.randn(inner, cols, generator=gen)  # [inner, cols]
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    with torch.inference_mode():
        f32 = _median_s(lambda: a @ b, PROBE_BUDGET_S)
        bf16 = _median_s(lambda: a16 @ b16, PROBE_BUDGET_S)
    return f32 / bf16


def _cache_file() -> Path:
    if os.environ.get("PAGECLI_CACHE_DIR"):
        return Path(os.environ["PAGECLI_CACHE_DIR"]) / "cpu_dtype_probe.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagecli" / "cpu_dtype_probe.json"


def _machine_key(flags: set[str]) -> str:
    parts = [
        cpu_model(platform.processor()),
        " ".join(sorted(flags)),
        torch.__version__,
        str(torch.get_num_threads()),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def cached_probe(flags: set[str], probe=probe_bf16_speedup) -> float:
    """`probe()`'s result for this machine, measured once and kept in the user cache."""
    path, key = _cache_file(), _machine_key(flags)
    try:
        cached = json.loads(path.read_text())
        if isinstance(cached.get(key), (int, float)):
            return float(cached[key])
    except (OSError, ValueError, AttributeError):
        cached = {}
    speedup = probe()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, key: speedup}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the probe again next time
    return speedup


def choose_cpu_dtype(flags: set[str] | None = None, probe=None) -> DTypeChoice:
    """`--dtype auto` on the CPU. `flags` and `probe` (a function returning the bfloat16
    speed-up) default to this machine's; tests inject them."""
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if not native:
        return DTypeChoice(
            torch.float32, "auto: float32, the CPU has no native bfloat16 (no AMX or AVX512_BF16)"
        )
    speedup = probe() if probe is not None else cached_probe(flags)
    if speedup < MIN_PROBE_SPEEDUP:
        return DTypeChoice(
            torch.float32,
            f"auto: float32, the CPU has {native[0]} but a bfloat16 matmul ran only "
            f"{speedup:.1f}x float32's speed",
        )
    return DTypeChoice(
        torch.bfloat16,
        f"auto: bfloat16, the CPU has {native[0]} and a bfloat16 matmul ran {speedup:.1f}x "
        "float32's speed",
    )


def choose_dtype(dtype: str, device: torch.device, quantized: bool = False) -> DTypeChoice:
    """The engine's dtype for `--dtype` (auto, float32, bfloat16, float16) on `device`;
    `quantized`: the weights stay in block formats (pagecli.loader.weight_plan.quantizes)."""
    if dtype != "auto":
        return DTypeChoice(getattr(torch, dtype), f"{dtype}, as asked (--dtype)")
    if device.type == "cuda":
        return DTypeChoice(torch.bfloat16, "auto: bfloat16 on CUDA")
    if quantized:
        return DTypeChoice(
            torch.float32, "auto: float32, the quantized weights' kernels compute in float32"
        )
    return choose_cpu_dtype()
