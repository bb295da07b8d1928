"""The CPU's native library (csrc/): build, load, and call its paged-attention kernel.

The C source is compiled on first use with the system C compiler (`$CC`, else `cc`) for the
architecture's baseline (`-O3 -fopenmp`, no -march=native: the AVX2 and AVX-512 versions are
per-function target attributes) into the user cache, keyed by the source, the compiler and
the CPU's flags, and loaded with ctypes. It shares torch's OpenMP runtime (the library is
loaded after torch's libgomp, under the same soname).

The CPU's features are read once, in C (csrc/cpu_features.c); the instruction-set path is
the widest this CPU runs (`isa()`) unless pagecli_kernels/settings.py chose another one of
`supported_isas()` (tests run them all). That module sets every kernel choice of the process.

Every C file of csrc/ goes into this one library: the attention kernel (bound here), the
fused small ops (fused_cpu.py), the quantized linear kernels (quant_cpu.py) and the decoder
layers that string them together (layers_cpu.py). Each of those modules binds the argument
types of its own functions; `build_and_load(name, sources, flags)` does the building.

Nothing here is required: without a compiler, on a C library without OpenMP, or with
PAGECLI_NATIVE_KERNELS=0, `library()` returns None, `unavailable_reason()` says why, and
pagecli_kernels/cpu.py keeps its torch path (as it does with the settings' `native=False`).
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
SOURCE = CSRC / "paged_attention_cpu.c"  # includes paged_attention_cpu_body.h once per ISA
# built into the same library: the fused small ops (fused_cpu.py), the quantized linear
# kernels (quant_cpu.py) and the decoder layers in one call (layers_cpu.py)
EXTRA_SOURCES = [
    CSRC / name
    for name in (
        "cpu_features.c",
        "cpu_ops.c",
        "quant_linear_cpu.c",
        "quant_q4_q8.c",
        "quant_q5.c",
        "quant_k.c",
        "quant_f32.c",
        "quant_bf16.c",
        "gemm_f32.c",
        "gemm_bf16.c",
        "gemm_quant_amx.c",
        "gated_delta_cpu.c",
        "layer_program_cpu.c",
        "quantize_cpu.c",
        "shm_collective.c",
    )
]
# No -march=native: each ISA path carries its own target attributes, so the portable one
# runs anywhere and the choice is made at run time.
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-Wno-psabi"]
ISAS = ("portable", "avx2", "avx512")  # csrc/cpu_features.h: enum cpu_isa's order
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
BUILD_TIMEOUT_S = 120

_lock = threading.Lock()
_state: dict = {"tried": False, "lib": None, "reason": None, "enabled": True, "isa": None}


def enabled() -> bool:
    """Whether the native kernel is built and turned on."""
    return _state["enabled"] and library() is not None


def supported_isas() -> list[str]:
    """The instruction-set paths this CPU runs, narrowest first ([] without the library)."""
    lib = library()
    if lib is None:
        return []
    return [name for i, name in enumerate(ISAS) if lib.pagecli_isa_supported(i)]


def isa() -> str | None:
    """The path every kernel runs: the widest supported unless the settings chose another."""
    if _state["isa"] is None:
        found = supported_isas()
        _state["isa"] = found[-1] if found else None
    return _state["isa"]


# csrc/cpu_features.h: CPU_BIT_*
_FEATURE_BITS = {
    "intel": 1,
    "avx512_bf16": 2,
    "avx512_vnni": 4,
    "amx": 8,
    "amx_granted": 16,
}


def cpu_features() -> dict[str, object]:
    """What the library found on this CPU ({} without it): its paths (`supported_isas()`),
    and whether it is Intel's, AMD's family, AVX512_BF16, AVX512_VNNI (with AVX-512), AMX,
    and AMX granted by Linux."""
    lib = library()
    if lib is None:
        return {}
    bits = lib.pagecli_cpu_feature_bits()
    found: dict[str, object] = {"isas": supported_isas()}
    found.update({name: bool(bits & bit) for name, bit in _FEATURE_BITS.items()})
    found["amd_family"] = lib.pagecli_cpu_amd_family() or None
    return found


def loaded() -> bool:
    """Whether the library is built and loaded already (`library()` builds it on first use)."""
    return _state["lib"] is not None


def status() -> str:
    """One of "loaded", "not loaded" (not asked for yet), "unavailable: <why>"; builds nothing."""
    if _state["lib"] is not None:
        return "loaded"
    return f"unavailable: {_state['reason']}" if _state["tried"] else "not loaded"


def _configure(enabled: bool, isa: str | None) -> None:
    """The settings' part (pagecli_kernels/settings.py): the native kernels on or off, and
    the path of every kernel (None: the widest; a library not loaded yet starts there).
    ValueError for a path this CPU lacks."""
    if isa is not None and isa not in supported_isas():
        raise ValueError(f"isa {isa!r} is not supported on this CPU (it runs {supported_isas()})")
    if loaded():
        found = supported_isas()
        if _state["lib"].pagecli_quant_set_isa(ISAS.index(isa or found[-1])) != 0:
            raise ValueError(f"isa {isa!r}: the quantized kernels refused it")
    _state["enabled"] = enabled
    _state["isa"] = isa


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
    lib = build_and_load("pagecli_cpu", [SOURCE, *EXTRA_SOURCES], FLAGS)
    fn = lib.pagecli_paged_attention
    i64, i32 = ctypes.c_int64, ctypes.c_int
    ptr = ctypes.c_void_p
    fn.argtypes = [i32, i32, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, ptr]
    fn.argtypes += [i32, i32, i32, i32, i32, ctypes.c_float, i32, ptr, i32, i32]
    fn.restype = i32
    lib.pagecli_isa_supported.argtypes = [i32]
    lib.pagecli_isa_supported.restype = i32
    lib.pagecli_quant_set_isa.argtypes = [i32]
    lib.pagecli_quant_set_isa.restype = i32
    lib.pagecli_cpu_feature_bits.restype = i32
    lib.pagecli_cpu_amd_family.restype = i32
    return lib


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes these (checked) inputs: float32, bfloat16 or float16
    CPU caches with the same strides and a contiguous last dimension."""
    return (
        query.device.type == "cpu"
        and k_cache.dtype in KV_DTYPES
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(-1) == 1
        and enabled()
    )


# Split-K: cut contexts into pieces of this many tokens when the batch has too few
# (sequence, kv head) items to keep every thread busy (see benchmarks/cpu_attention.py).
SPLIT_TOKENS = 256


def choose_split_tokens(num_items: int, max_seq_len: int, num_threads: int) -> int:
    """Context tokens per split (0: no split-K) for a call with `num_items` natural items
    ((sequence, kv head) pairs: count a sequence once however many of its rows the call has,
    `distinct_sequences`) whose longest context is `max_seq_len`.

    A row's bits then do not depend on the other rows of its call, only on the sequences:
    a context of at most SPLIT_TOKENS is one split, whose combine gives the bits of no split
    (with sinks too: the first split holds the sink), and a longer one is cut at the same
    tokens in any call that cuts. So speculative decoding's k + 1 verify rows of a sequence
    get the bits its decodes get one at a time."""
    if num_threads > 1 and num_items < 4 * num_threads and max_seq_len > SPLIT_TOKENS:
        return SPLIT_TOKENS
    return 0


def distinct_sequences(block_tables: torch.Tensor) -> int:
    """The sequences among a call's rows: rows with the same first block are one sequence's
    (speculative decoding lays out its verify rows as decodes of one block table)."""
    if block_tables.shape[0] <= 1 or block_tables.shape[1] == 0:
        return block_tables.shape[0]
    return len(set(block_tables[:, 0].tolist()))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    split_tokens: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention through the C kernel (decodes are 1-token queries); inputs
    already checked, `supports()` true. query [num_tokens, num_heads, D] -> same shape.

    split_tokens None lets `choose_split_tokens` decide; 0 turns split-K off. `window` and
    `sinks` as pagecli_kernels.ops describes them (checked).
    """
    lib = library()
    assert lib is not None
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    threads = torch.get_num_threads()
    if split_tokens is None:
        context = max_seq_len if window is None else min(max_seq_len, window)
        items = distinct_sequences(block_tables) * num_kv_heads
        split_tokens = choose_split_tokens(items, context, threads)
    sinks32 = None if sinks is None else sinks.to(torch.float32).contiguous()  # [H]
    query32 = query.to(torch.float32).contiguous()  # [T, H, D], converted once (small)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    out = torch.empty_like(query32)  # [T, H, D] float32
    status = lib.pagecli_paged_attention(
        ISAS.index(isa()),
        KV_DTYPES[k_cache.dtype],
        query32.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_blocks,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        window or 0,
        None if sinks32 is None else sinks32.data_ptr(),
        split_tokens,
        threads,
    )
    if status == -1:
        raise ValueError(f"block_tables holds a block id outside [0, {num_blocks})")
    if status != 0:
        raise MemoryError("paged attention: out of memory for its work buffers")
    return out if query.dtype == torch.float32 else out.to(query.dtype)
