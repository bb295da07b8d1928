"""The CPU's native decode-attention kernel (csrc/paged_attention_cpu.c): build, load, call.

The C source is compiled on first use with the system C compiler (`$CC`, else `cc`) for this
CPU (`-O3 -march=native -fopenmp`) into the user cache, keyed by the source, the compiler and
the CPU's flags, and loaded with ctypes. It shares torch's OpenMP runtime (the library is
loaded after torch's libgomp, under the same soname).

`build_and_load(name, sources, flags)` is the builder for every C library in csrc/ (this
module's attention kernel; quant_cpu.py's quantized linear kernels): each library module keeps
its own state and argument types.

Nothing here is required: without a compiler, on a C library without OpenMP, or with
PAGECLI_NATIVE_KERNELS=0, `library()` returns None, `unavailable_reason()` says why, and
pagecli_kernels/cpu.py keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "paged_attention_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "reason": None, "enabled": True}


def set_enabled(enabled: bool) -> None:
    """Turn the native kernel on or off for this process (tests and benchmarks compare both)."""
    _state["enabled"] = enabled


def enabled() -> bool:
    return _state["enabled"] and library() is not None


def unavailable_reason() -> str | None:
    """Why `library()` is None, or None when it loaded."""
    library()
    return _state["reason"]


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None when it cannot be had."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                _state["lib"] = _load()
            except _Unavailable as exc:
                _state["reason"] = str(exc)
        return _state["lib"]


class NativeUnavailable(Exception):
    """A native library cannot be built or loaded here; the message says why."""


_Unavailable = NativeUnavailable


def _cache_dir() -> Path:
    if os.environ.get("PAGECLI_CACHE_DIR"):
        return Path(os.environ["PAGECLI_CACHE_DIR"]) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagecli" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_and_load(name: str, sources: list[Path], flags: list[str]) -> ctypes.CDLL:
    """Compile C `sources` (with the csrc/ headers) into one shared library in the user cache,
    keyed by the sources, the headers, the compiler, `flags` and the CPU's flags; load it.

    Raises NativeUnavailable (with the reason) where it cannot be built or loaded. Each
    library's module keeps its own state; this only builds and loads.
    """
    if os.environ.get("PAGECLI_NATIVE_KERNELS", "1") == "0":
        raise _Unavailable("turned off by PAGECLI_NATIVE_KERNELS=0")
    if platform.system() != "Linux":
        raise _Unavailable(f"built only on Linux, this is {platform.system()}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise _Unavailable("no C compiler (cc or $CC) found")
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Unavailable(f"{compiler} --version failed: {exc}") from None
    headers = sorted(CSRC.glob("*.h"))
    texts = [f.read_text() for f in [*sources, *headers]]
    key = hashlib.sha256(
        "\0".join([*texts, version, " ".join(flags), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    folder = _cache_dir()
    path = folder / f"{name}-{key}.so"
    if not path.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                built = Path(tmp) / path.name
                result = subprocess.run(
                    [compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                )
                if result.returncode != 0:
                    first = (result.stderr.strip().splitlines() or ["no output"])[0]
                    raise _Unavailable(f"compiling {name} failed: {first}")
                os.replace(built, path)  # atomic: a concurrent build writes the same file
        except (OSError, subprocess.SubprocessError) as exc:
            raise _Unavailable(f"building {name} failed: {exc}") from None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise _Unavailable(f"loading {path} failed: {exc}") from None


def _load() -> ctypes.CDLL:
    lib = build_and_load("paged_attention_cpu", [SOURCE], FLAGS)
    fn = lib.pagecli_paged_decode_f32
    i64, i32 = ctypes.c_int64, ctypes.c_int
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr]
    fn.argtypes += [i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return lib


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these (checked) inputs: float32 CPU caches with the
    same strides and a contiguous last dimension."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(-1) == 1
        and enabled()
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention through the C kernel; inputs already checked, `supports()` true."""
    lib = library()
    assert lib is not None
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(query)
    status = lib.pagecli_paged_decode_f32(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_blocks,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    if status == -1:
        raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
    if status != 0:
        raise MemoryError("paged decode attention: out of memory for its score buffers")
    return out
