"""Quantized linear layers on the CPU: the C kernels of csrc/quant_*.c, built, loaded, called.

`quant_linear(x, w)` computes `x @ dequant(w).T` in float32 from a `QuantWeight`'s packed
blocks; `dequantize(w, row_ids)` turns whole rows into float32 (an embedding lookup, or the
dequantize-everything fallback). The kernels are part of native.py's library, built for
the architecture's baseline; their AVX2 and AVX-512 functions carry target attributes, and the
path is chosen at run time from the CPU's features (`isa()`). Every choice below is set for
the process by pagecli_kernels/settings.py (KernelSettings); the functions here report them.

For more than a few input rows the kernels multiply cache-sized float32 panels of W with
torch's own BLAS (MKL's `sgemm_` in libtorch_cpu, looked up once here), or with the library's
own AVX-512 GEMM (csrc/gemm_f32.c) on AVX-512 CPUs that are not Intel's, where MKL runs its
AVX2 code (`gemm()`); with neither, every call takes the fused path, correct but slower for
prefill. On CPUs with AMX, the formats with a scale per 32 values (Q8_0, Q4_0, Q4_1, Q4_K,
Q5_K) and Q6_K multiply such batches on AMX's tiles instead (csrc/gemm_quant_amx.c: the
activations split exactly into three bfloat16 parts, Q6_K's weights `sc * (q - 32)` into two,
float32 sums; `tiles()`).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from pagecli_kernels import native
from pagecli_kernels.quant_formats import BF16, QuantWeight

ISAS = native.ISAS
_ERRORS = {-1: "unknown format or columns not whole blocks", -2: "row id out of range"}

_lock = threading.Lock()
_state: dict = {"bound": False, "blas": False}


def library() -> ctypes.CDLL | None:
    """native.py's library with the quantized kernels bound; None when it cannot be had."""
    lib = native.library()
    if lib is None:
        return None
    with _lock:
        if not _state["bound"]:
            _bind(lib)
            _state["bound"] = True
    return lib


def unavailable_reason() -> str | None:
    """Why `library()` is None, or None when it loaded."""
    return native.unavailable_reason()


def supported_isas() -> list[str]:
    """The instruction-set paths this CPU runs, narrowest first ([] without the library)."""
    return native.supported_isas() if library() is not None else []


def isa() -> str | None:
    """The path the kernels run (the widest supported unless the settings chose another)."""
    lib = library()
    return None if lib is None else ISAS[lib.pagecli_quant_isa()]


PREFETCH_LEVELS = ("l1", "l2")  # pagecli_quant_set_prefetch's levels 1 and 2


def prefetch() -> str | None:
    """The cache level the batch-1 kernels prefetch W into: "l1" or "l2" (None: no library).
    By default the L2 on AMD CPUs before Zen 5, the L1 elsewhere."""
    lib = library()
    return None if lib is None else PREFETCH_LEVELS[lib.pagecli_quant_prefetch() - 1]


GEMMS = ("auto", "blas", "native", "off")  # pagecli_quant_set_gemm's choices


def gemm() -> str | None:
    """Who multiplies the panels of large batches now: "native" (csrc/gemm_f32.c), "blas"
    (torch's sgemm), or None (no library, or neither: the fused path takes every batch).
    Under "auto": native where the path is AVX-512 on a CPU that is not Intel's, whose AVX-512
    code MKL skips, the BLAS elsewhere; on Intel's AVX-512 CPUs, "blas" takes prefill on rows
    of fewer than 2048 values, while batches of 32 to 128 rows (batched decode) and rows of
    2048 values or more take the native kernel."""
    lib = library()
    if lib is None:
        return None
    return {1: "blas", 2: "native"}.get(lib.pagecli_quant_gemm())


TILES = ("auto", "off", "on")  # pagecli_quant_set_tiles's choices
# a split in csrc/gemm_quant_amx.c: a scale per 32 values, or Q6_K's 8-bit scales folded into
# its weights (Q5_0, Q5_1, the IQ4 formats and MXFP4 have none)
TILES_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")


def tiles() -> bool:
    """Whether batches of more than a few rows of TILES_FORMATS multiply on AMX's tiles under
    the settings in effect (csrc/gemm_quant_amx.c); float rows never do. Under "auto": on the
    AVX-512 path where Linux grants the tiles; "on" needs AMX and AVX-512."""
    lib = library()
    return lib is not None and bool(lib.pagecli_quant_tiles())


INT_DOTS = ("auto", "off", "on")  # pagecli_quant_set_int_dots's choices
INT_DOTS_FORMATS = ("q4_k", "q6_k")  # formats with an integer path on both paths
INT_DOTS_FORMATS_AVX2_AUTO = INT_DOTS_FORMATS + ("q5_k",)  # on the AVX2 path, at every batch
INT_DOTS_FORMATS_AVX2 = INT_DOTS_FORMATS_AVX2_AUTO + ("q4_0", "q4_1")  # and there, when on


def int_dots() -> bool:
    """Whether products of the formats in int_dots_formats() take an integer path now
    (csrc/quant_k.c: each input row split into two int16 parts per super-block): batch-1
    products on the AVX-512 path of a CPU with VNNI, and the fused path's products of any
    number of rows on the AVX2 path. Under "auto": on wherever one runs."""
    lib = library()
    return lib is not None and bool(lib.pagecli_quant_int_dots())


def int_dots_formats() -> tuple[str, ...]:
    """The formats whose products take an integer path under the settings in effect: Q4_K
    and Q6_K where int_dots() is on (on the AVX-512 path Q4_K only where vnni_q4_k() is), on
    the AVX2 path also Q5_K, and there under "on" also Q4_0 and Q4_1 (csrc/quant_q4_q8.c: a
    scale per 32-value block), at every batch; under "auto" those two keep the float kernels
    (their 2-8 rows are faster there, and a row keeps one kernel's bits at every batch)."""
    lib = library()
    if lib is None or not lib.pagecli_quant_int_dots():
        return ()
    if isa() == "avx2":
        return (
            INT_DOTS_FORMATS_AVX2 if lib.pagecli_quant_int_dots_on() else INT_DOTS_FORMATS_AVX2_AUTO
        )
    return INT_DOTS_FORMATS if vnni_q4_k() else ("q6_k",)


VNNI_Q4_K = ("auto", "off", "on")  # pagecli_quant_set_vnni_q4_k's choices


def vnni_q4_k() -> bool:
    """Whether Q4_K may take AVX-512 VNNI's integer kernels, where int_dots() says the
    integer paths run: under "auto" on AMD's CPUs with VNNI (faster than the float kernels on
    a Zen 4), not on Intel's (slower than the float kernels on a Xeon with AMX: there Q4_K
    keeps the float kernels at every batch); "on" needs VNNI."""
    lib = library()
    return lib is not None and bool(lib.pagecli_quant_vnni_q4_k())


SMALL_BATCHES = ("auto", "off", "on")  # pagecli_quant_set_small_batches's choices


def small_batches() -> bool:
    """Whether 2-8 input rows take the small-batch kernels (AVX-512: R weight rows at a time
    sharing each load of x, where the format has them) and the row kernels pieces of x that
    stay in the L1; off, the row kernels take whole rows: the same bits, slower."""
    lib = library()
    return lib is not None and bool(lib.pagecli_quant_small_batches())


def small_batches_all() -> bool:
    """Whether the small-batch kernels that "auto" keeps to Intel's CPUs run too: Q4_K's for
    2-4 input rows and the half-sum kernels for 5-8 (measured on a Xeon only). "on" runs them
    on any CPU with AVX-512, with the same bits (tests, and measurements elsewhere)."""
    lib = library()
    return lib is not None and bool(lib.pagecli_quant_small_batches_all())


def fused_rows() -> int:
    """Batches of up to this many input rows take the fused decode path now (8 unless the
    `fused_rows` setting asks for more), where every output has the bits it has at one input
    row: the verify rows of speculative decoding rely on it. Larger batches take the panels
    or AMX's tiles, which sum in another order. 0 without the library."""
    lib = library()
    return lib.pagecli_quant_fused_rows() if lib is not None else 0


BF16_GEMMS = ("auto", "off", "pairs", "tiles", "float32")  # pagecli_bf16_set_gemm's choices


def bf16_gemm() -> str | None:
    """Who multiplies bfloat16 inputs of more rows than the row kernels take (`bf16_linear`):
    "tiles" (AMX's TDPBF16PS, csrc/gemm_bf16.c), "pairs" (the pair GEMM there, on VDPBF16PS
    where the CPU has AVX512_BF16), "float32" (the input widened, the float32 panels), "off"
    (the caller keeps torch's bfloat16 GEMM), or None (no library). Under "auto", on the
    AVX-512 path: the tiles where the CPU has AMX and Linux grants them, else pairs where the
    CPU has AVX512_BF16 and no AMX; on the AVX2 path float32 (torch's bfloat16 GEMM has no
    native products there); "tiles" needs AMX."""
    lib = library()
    if lib is None:
        return None
    return ("off", "pairs", "tiles", "float32")[lib.pagecli_bf16_gemm()]


def bf16_tiles() -> bool:
    """Whether this CPU has AMX's bfloat16 tiles and the kernel granted them to us."""
    lib = library()
    return lib is not None and bool(lib.pagecli_bf16_tiles())


def bf16_gemm_native() -> bool:
    """Whether the pair GEMM runs VDPBF16PS here (else its portable loop)."""
    lib = library()
    return lib is not None and bool(lib.pagecli_bf16_gemm_native())


def _configure(
    prefetch: str,
    gemm: str,
    tiles: str,
    int_dots: str,
    small_batches: str,
    bf16_gemm: str,
    fused_rows: int = 0,
    vnni_q4_k: str = "auto",
) -> None:
    """The settings' part (pagecli_kernels/settings.py): each choice into the library.
    ValueError for a choice this CPU, its kernel or this build cannot run."""
    levels = ("auto", *PREFETCH_LEVELS)
    _choose("pagecli_quant_set_prefetch", levels, prefetch, "prefetch")
    _choose("pagecli_quant_set_gemm", GEMMS, gemm, "gemm")
    _choose("pagecli_quant_set_tiles", TILES, tiles, "tiles")
    _choose("pagecli_quant_set_small_batches", SMALL_BATCHES, small_batches, "small_batches")
    _choose("pagecli_bf16_set_gemm", BF16_GEMMS, bf16_gemm, "bf16_gemm")
    _choose("pagecli_quant_set_vnni_q4_k", VNNI_Q4_K, vnni_q4_k, "vnni_q4_k")
    _configure_step(int_dots, fused_rows)


def _configure_step(int_dots: str, fused_rows: int) -> None:
    """The two choices a decode step may change (settings._STEP_FIELDS), as _configure sets
    them."""
    _choose("pagecli_quant_set_int_dots", INT_DOTS, int_dots, "int_dots")
    if library().pagecli_quant_set_fused_rows(fused_rows) != 0:
        raise ValueError(f"fused_rows {fused_rows}: out of range")


def _choose(setter: str, choices: tuple[str, ...], choice: str, what: str) -> None:
    """Pass `choice`'s index in `choices` to the library's `setter`."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"quantized kernels unavailable: {unavailable_reason()}")
    if choice not in choices:
        raise ValueError(f"{what} {choice!r}: choose one of {choices}")
    if getattr(lib, setter)(choices.index(choice)) == -2:
        raise ValueError(f"{what} {choice!r}: not available on this CPU, kernel or build")


def bf16_linear(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """`x @ weight.T` for a bfloat16 CPU `x` [M, cols] (unit column stride) and a BF16
    `QuantWeight` -> [M, rows] float32 sums of the exact products (csrc/gemm_bf16.c)."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"quantized kernels unavailable: {unavailable_reason()}")
    if (
        weight.format.ggml_type != BF16.ggml_type
        or x.dtype != torch.bfloat16
        or x.device.type != "cpu"
    ):
        raise ValueError("bf16_linear takes bfloat16 CPU input and a BF16 weight")
    if x.dim() != 2 or x.shape[1] != weight.cols:
        raise ValueError(f"input must be [M, {weight.cols}]")
    if x.stride(-1) != 1 or x.stride(0) % 2:
        x = x.contiguous()
    num_rows = x.shape[0]
    out = torch.empty(num_rows, weight.rows)  # [M, N] float32
    if num_rows:
        status = lib.pagecli_bf16_linear(
            weight.data.data_ptr(), weight.rows, weight.cols, x.data_ptr(),
            x.stride(0) if num_rows > 1 else weight.cols, num_rows, out.data_ptr(),
            weight.rows, torch.get_num_threads(),
        )  # fmt: skip
        _check(status, "bf16_linear")
    return out


def has_blas() -> bool:
    """Whether the panel path found torch's sgemm (else large batches take the fused path)."""
    library()
    return _state["blas"]


def _torch_blas() -> tuple[int | None, int | None]:
    """Addresses of sgemm_ and MKL_Set_Num_Threads_Local (C, by value) in libtorch_cpu."""
    for path in sorted((Path(torch.__file__).parent / "lib").glob("libtorch_cpu*")):
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:
            continue
        found = []
        for symbol in ("sgemm_", "MKL_Set_Num_Threads_Local"):
            fn = getattr(lib, symbol, None)
            found.append(None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value)
        return found[0], found[1]
    return None, None


def _bind(lib: ctypes.CDLL) -> None:
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.pagecli_quant_linear.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.pagecli_quant_dequantize_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32]
    lib.pagecli_quant_set_isa.argtypes = [i32]
    lib.pagecli_quantize_rows.argtypes = [i32, ptr, i64, i64, ptr, i32]
    lib.pagecli_quantize_rows.restype = i32
    lib.pagecli_quant_set_prefetch.argtypes = [i32]
    lib.pagecli_quant_set_prefetch.restype = i32
    lib.pagecli_quant_prefetch.restype = i32
    lib.pagecli_quant_set_blas.argtypes = [ptr, ptr]
    lib.pagecli_quant_set_blas.restype = None
    lib.pagecli_quant_set_gemm.argtypes = [i32]
    lib.pagecli_quant_set_gemm.restype = i32
    lib.pagecli_quant_gemm.restype = i32
    lib.pagecli_quant_set_tiles.argtypes = [i32]
    lib.pagecli_quant_set_tiles.restype = i32
    lib.pagecli_quant_tiles.restype = i32
    lib.pagecli_quant_set_int_dots.argtypes = [i32]
    lib.pagecli_quant_set_int_dots.restype = i32
    lib.pagecli_quant_int_dots.restype = i32
    lib.pagecli_quant_int_dots_on.restype = i32
    lib.pagecli_quant_set_vnni_q4_k.argtypes = [i32]
    lib.pagecli_quant_set_vnni_q4_k.restype = i32
    lib.pagecli_quant_vnni_q4_k.restype = i32
    lib.pagecli_quant_set_small_batches.argtypes = [i32]
    lib.pagecli_quant_set_small_batches.restype = i32
    lib.pagecli_quant_small_batches.restype = i32
    lib.pagecli_quant_small_batches_all.restype = i32
    lib.pagecli_quant_set_fused_rows.argtypes = [i32]
    lib.pagecli_quant_set_fused_rows.restype = i32
    lib.pagecli_quant_fused_rows.restype = i32
    lib.pagecli_bf16_linear.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.pagecli_bf16_linear.restype = i32
    lib.pagecli_bf16_set_gemm.argtypes = [i32]
    lib.pagecli_bf16_set_gemm.restype = i32
    lib.pagecli_bf16_gemm.restype = i32
    lib.pagecli_bf16_gemm_native.restype = i32
    lib.pagecli_bf16_tiles.restype = i32
    for fn in ("pagecli_quant_linear", "pagecli_quant_dequantize_rows", "pagecli_quant_set_isa"):
        getattr(lib, fn).restype = i32
    lib.pagecli_quant_isa.restype = i32
    sgemm, set_threads = _torch_blas()
    lib.pagecli_quant_set_blas(sgemm, set_threads if sgemm else None)
    _state["blas"] = sgemm is not None


def _check(status: int, what: str) -> None:
    if status == -3:
        raise MemoryError(f"{what}: out of memory for a weight panel")
    if status != 0:
        raise ValueError(f"{what}: {_ERRORS.get(status, f'status {status}')}")


def quant_linear(
    x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ dequant(weight).T` for float32 CPU `x` [..., cols] -> [..., rows], float32 sums.

    Rows of `x` may be strided (others are copied). `out`, if given, is a float32 [M, rows]
    view whose rows may be strided (a column slice of a wider output) and is returned.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"quantized kernels unavailable: {unavailable_reason()}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quant_linear takes float32 CPU input, got {x.dtype} on {x.device}")
    if x.shape[-1] != weight.cols:
        raise ValueError(f"input has {x.shape[-1]} features, the weight {weight.cols}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, weight.cols)  # [M, K], a view where the strides allow
    if x2d.stride(-1) != 1 or (x2d.shape[0] > 1 and x2d.stride(0) < weight.cols):
        x2d = x2d.contiguous()
    num_rows = x2d.shape[0]
    if out is None:
        out = torch.empty(num_rows, weight.rows, dtype=torch.float32)  # [M, N]
    elif out.shape != (num_rows, weight.rows) or out.stride(-1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be float32 [{num_rows}, {weight.rows}] with unit stride")
    if num_rows:
        status = lib.pagecli_quant_linear(
            weight.format.ggml_type,
            weight.data.data_ptr(),
            weight.rows,
            weight.cols,
            x2d.data_ptr(),
            x2d.stride(0) if num_rows > 1 else weight.cols,
            num_rows,
            out.data_ptr(),
            out.stride(0) if num_rows > 1 else weight.rows,
            torch.get_num_threads(),
        )
        _check(status, "quant_linear")
    return out if len(lead) == 1 else out.view(*lead, weight.rows)


def dequantize(weight: QuantWeight, row_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `row_ids` (int64, any shape; None: all rows) of `weight` in float32:
    [*row_ids.shape, cols], or [rows, cols]."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"quantized kernels unavailable: {unavailable_reason()}")
    if row_ids is None:
        ids_ptr, num_ids, lead = None, weight.rows, (weight.rows,)
    else:
        ids = row_ids.to(torch.int64).contiguous().view(-1)  # [num_ids]
        ids_ptr, num_ids, lead = ids.data_ptr(), ids.numel(), tuple(row_ids.shape)
    out = torch.empty(num_ids, weight.cols, dtype=torch.float32)  # [num_ids, K]
    status = lib.pagecli_quant_dequantize_rows(
        weight.format.ggml_type,
        weight.data.data_ptr(),
        weight.rows,
        weight.cols,
        ids_ptr,
        num_ids,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    _check(status, "dequantize")
    return out.view(*lead, weight.cols)


def quantize_q4_k_rows(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 CPU rows [rows, cols] (cols a multiple of 256) -> Q4_K blocks, uint8
    [rows, cols / 256 * 144]: csrc/quantize_cpu.c, byte for byte loader/quantize.py's port of
    ggml's quantizer, rows shared among the threads. `out`: where to write them."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"quantized kernels unavailable: {unavailable_reason()}")
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] % 256:
        raise ValueError(f"Q4_K takes float32 CPU rows of whole 256-blocks, got {tuple(x.shape)}")
    x = x.contiguous()
    rows, cols = x.shape
    shape = (rows, cols // 256 * 144)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    elif out.shape != shape or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous uint8 {shape}")
    status = lib.pagecli_quantize_rows(
        12, x.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()
    )
    if status:
        raise ValueError(f"quantize_rows: status {status}")
    return out


class PreparedLinear:
    """`quant_linear` for one weight, its constant arguments bound once: the per-call cost of
    a decode step's 120 small products is Python's, so the hot path does only what varies.
    Takes a float32 CPU `x2d` [M, cols] with unit column stride (the layer ensures it)."""

    __slots__ = ("_fn", "_head", "weight")

    def __init__(self, weight: QuantWeight) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError(f"quantized kernels unavailable: {unavailable_reason()}")
        self.weight = weight
        self._fn = lib.pagecli_quant_linear
        self._head = (weight.format.ggml_type, weight.data.data_ptr(), weight.rows, weight.cols)

    def __call__(self, x2d: torch.Tensor) -> torch.Tensor:
        num_rows, rows = x2d.shape[0], self._head[2]
        out = torch.empty(num_rows, rows)  # [M, N] float32
        if num_rows:
            ldx = x2d.stride(0) if num_rows > 1 else self._head[3]
            status = self._fn(
                *self._head, x2d.data_ptr(), ldx, num_rows, out.data_ptr(), rows,
                torch.get_num_threads(),
            )  # fmt: skip
            if status:
                _check(status, "quant_linear")
        return out
