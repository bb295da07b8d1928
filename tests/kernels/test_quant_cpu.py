"""The quantized CPU kernels (pagecli_kernels/quant_cpu.py) against their references.

Every format x every instruction-set path this machine runs (the portable one included):
- dequantization equals gguf.quants.dequantize bit for bit;
- `quant_linear` equals the float64 product of the dequantized weights within a per-format
  tolerance, for 1, 2, 3, 7, 8, 64 and 300 input rows (the fused decode path up to 8, the
  panel path above, through each GEMM: torch's sgemm, csrc/gemm_f32.c, and AMX's tiles
  (csrc/gemm_quant_amx.c) where the CPU has them; and the fused path for many rows when the
  panel path is off), odd output sizes, and input rows that are not contiguous.

Weights are random bytes with finite random f16 scales, so every bit pattern of the quants
occurs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagecli.engine.spec_decode.invariance import verify_kernel_settings
from pagecli_kernels import native, quant_cpu, reference
from pagecli_kernels.quant_formats import FORMATS, QuantWeight, float_rows
from pagecli_kernels.settings import applied, kernel_settings

# |y - y_ref| <= TOL * (|x| @ |W|.T) per output. The weights are exact in float32 (each is an
# f16 scale times a small integer, or a difference of two such products), so every format's
# error is float32 summation only: about sqrt(cols) * 2^-24 relative to the sum of |products|
# in practice, K * 2^-24 at worst; cols here are at most 768. AMX's tiles sum each block's
# exact products and then scale the block's sum (one more float32 rounding per block, in
# another order); they are held to the same tolerance.
TOLERANCES = {fmt: 2e-6 for fmt in FORMATS}
# Byte offsets of each block's f16 scales (random bytes there could be inf or NaN).
SCALE_OFFSETS = {
    "q8_0": [0],
    "q4_0": [0],
    "q4_1": [0, 2],
    "iq4_nl": [0],
    "iq4_xs": [0],  # its 6-bit sub-block scales: any bytes are valid
    "mxfp4": [],  # its scale is one E8M0 byte: random_weight keeps it finite and moderate
    "q5_0": [0],
    "q5_1": [0, 2],
    "q4_k": [0, 2],
    "q5_k": [0, 2],
    "q6_k": [208],
}
ROWS = [1, 2, 3, 7, 8, 64, 300]
FLOAT_DTYPES = [torch.float32, torch.bfloat16]


def random_weight(fmt: str, rows: int, cols: int, seed: int = 0) -> QuantWeight:
    """Random blocks of `fmt`: random quants, random finite scales."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    num_blocks = cols // f.block_values
    data = rng.integers(0, 256, size=(rows, num_blocks, f.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[fmt]:
        scales = (rng.standard_normal((rows, num_blocks)) * 0.02).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, num_blocks, 2)
    if fmt == "mxfp4":  # exponents 2^-10 .. 2^-3, and the two subnormal codes now and then
        data[:, :, 0] = rng.integers(118, 126, size=(rows, num_blocks), dtype=np.uint8)
        data[:, 0, 0] = rng.integers(0, 2, size=rows, dtype=np.uint8)
    return QuantWeight(f, torch.from_numpy(data.reshape(rows, -1)), cols)


def _cols(fmt: str) -> int:
    # an odd number of blocks: 3 super-blocks, or 23 blocks of 32
    return 768 if FORMATS[fmt].block_values == 256 else 736


@pytest.fixture(params=["portable", "avx2", "avx512"])
def isa(request):
    """Each instruction-set path in turn; those the CPU lacks are skipped (named)."""
    if quant_cpu.library() is None:
        pytest.fail(f"the quantized CPU kernels did not build: {quant_cpu.unavailable_reason()}")
    if request.param not in quant_cpu.supported_isas():
        pytest.skip(f"this CPU does not run the {request.param} path")
    with kernel_settings(isa=request.param):
        yield request.param


def assert_within(got: torch.Tensor, x: torch.Tensor, weight: QuantWeight, fmt: str) -> None:
    dense = reference.dequantize(weight).double()  # [N, K]
    want = x.double() @ dense.T  # [M, N]
    scale = x.double().abs() @ dense.abs().T
    err = ((got.double() - want).abs() / scale.clamp_min(1e-30)).max().item()
    assert err <= TOLERANCES[fmt], f"{fmt}: relative error {err:.2e} > {TOLERANCES[fmt]:.0e}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_equals_gguf_bit_for_bit(isa, fmt):
    weight = random_weight(fmt, 13, _cols(fmt))
    got = quant_cpu.dequantize(weight)  # [13, K]
    want = reference.dequantize(weight)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", ["q5_0", "q5_1"])
def test_q5_blocks_by_hand(isa, fmt):
    """The 5-bit layout, written out: value j's low four bits in the low nibble of qs[j]
    (j < 16) or the high one of qs[j - 16], its fifth bit bit j of qh (little-endian). Block
    b holds q_j = (j + b) % 32, so every q sits at every position once."""
    f = FORMATS[fmt]
    q = (np.arange(32)[None, :] + np.arange(32)[:, None]) % 32  # [blocks, 32]
    qs = (q[:, :16] & 15) | (q[:, 16:] & 15) << 4  # [blocks, 16]
    qh = ((q >> 4) << np.arange(32)).sum(axis=1).astype("<u4")  # [blocks]
    scales = [np.float16(0.375)] + ([np.float16(-1.5)] if fmt == "q5_1" else [])
    head = np.concatenate([np.frombuffer(s.tobytes(), dtype=np.uint8) for s in scales])
    data = np.concatenate(
        [np.tile(head, (32, 1)), qh.view(np.uint8).reshape(32, 4), qs.astype(np.uint8)], axis=1
    )  # [blocks, block_bytes]
    weight = QuantWeight(f, torch.from_numpy(data.reshape(1, -1).copy()), 32 * 32)
    want = 0.375 * q - 1.5 if fmt == "q5_1" else 0.375 * (q - 16)  # exact in float32
    want = torch.from_numpy(want.reshape(1, -1)).float()
    assert torch.equal(reference.dequantize(weight), want)
    assert torch.equal(quant_cpu.dequantize(weight), want)
    x = torch.randn(3, 32 * 32, generator=torch.Generator().manual_seed(4))
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_selected_rows(isa, fmt):
    weight = random_weight(fmt, 29, _cols(fmt), seed=1)
    ids = torch.tensor([[28, 0, 5], [5, 17, 3]])
    got = quant_cpu.dequantize(weight, ids)  # [2, 3, K]
    want = reference.dequantize(weight)[ids]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_linear_matches_float64(isa, fmt, rows):
    cols = _cols(fmt)
    weight = random_weight(fmt, 37, cols, seed=rows)  # 37 outputs: odd, not a panel multiple
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, fmt)


@pytest.fixture(params=["auto", "on"])
def small(request):
    """small_batches "auto", then "on" (the kernels auto keeps to Intel's CPUs, on any CPU
    with AVX-512); "on" is skipped (named) where it runs what auto runs: on Intel's CPUs, and
    off the AVX-512 path (after `isa` where a test asks for both)."""
    if request.param == "on" and (quant_cpu.small_batches_all() or quant_cpu.isa() != "avx512"):
        pytest.skip("small_batches on runs auto's kernels on this CPU and path")
    with kernel_settings(small_batches=request.param):
        yield request.param


def assert_bits_of_whole_rows(x: torch.Tensor, weight: QuantWeight, fmt: str) -> None:
    """x @ W.T as the small-batch paths take it (the small-batch kernels, pieces of x): within
    the float64 tolerance, and bit for bit the rows kernel's over whole rows (small_batches
    "off")."""
    got = quant_cpu.quant_linear(x, weight)
    with kernel_settings(small_batches="off"):
        assert not quant_cpu.small_batches()
        whole = quant_cpu.quant_linear(x, weight)
    assert_within(got, x, weight, fmt)
    assert torch.equal(got.view(torch.int32), whole.view(torch.int32))


@pytest.mark.parametrize("rows", [3, 5, 8])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_long_rows_in_pieces_give_the_bits_of_whole_rows(isa, small, fmt, rows):
    """A batch of 3-8 input rows too long for the L1 goes through the row kernels (5-8 rows on
    Intel's CPUs: the half-sum kernels) piece by piece, each row's sums kept between pieces
    (17 super-blocks or 137 blocks: the last piece shorter; 37 outputs: the last group of
    weight rows shorter). The result is the float64 product's within the tolerance, and bit
    for bit that of whole rows."""
    cols = 17 * 256 if FORMATS[fmt].block_values == 256 else 137 * 32
    weight = random_weight(fmt, 37, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    assert_bits_of_whole_rows(x, weight, fmt)


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_small_batch_kernels_give_the_bits_of_the_rows_kernel(isa, small, fmt, rows):
    """2-8 input rows: the small-batch kernels (AVX-512; R weight rows sharing each load of x;
    5-8 rows in two passes, or, on Intel's CPUs, the half-sum kernels: 3 weight rows at 5-6
    inputs, 2 at 7-8, one of the rows kernel's two sums a pass) sum each (row, input) as the
    rows kernel does; 37 outputs leave a last group shorter than R."""
    cols = _cols(fmt)
    weight = random_weight(fmt, 37, cols, seed=rows + 10)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + 10))
    assert_bits_of_whole_rows(x, weight, fmt)


def test_small_batches_choices():
    assert quant_cpu.small_batches()
    assert quant_cpu.small_batches_all() == native.cpu_features()["intel"]
    with kernel_settings(small_batches="on"):
        assert quant_cpu.small_batches() and quant_cpu.small_batches_all()
    with kernel_settings(small_batches="off"):
        assert not quant_cpu.small_batches() and not quant_cpu.small_batches_all()
    with pytest.raises(ValueError, match="small_batches"):
        with kernel_settings(small_batches="always"):
            pass


# Formats whose AVX2 functions are also their AVX-512 ones (csrc/quant_q5.c).
AVX2_ONLY_FORMATS = ["q5_0", "q5_1"]


@pytest.mark.parametrize(
    ("path", "fmt"), [(path, fmt) for path in ("avx512", "avx2") for fmt in FORMATS]
)
def test_batch_one_gives_a_row_the_same_bits_in_a_group_or_alone(path, fmt):
    """One input row: the wide kernels (several weight rows at a time) sum each row in the
    order of its row kernel, so a row's output does not depend on its neighbours."""
    if path not in quant_cpu.supported_isas():
        pytest.skip(f"this CPU does not run the {path} path")
    with kernel_settings(isa=path):
        cols = _cols(fmt)
        weight = random_weight(fmt, 9, cols, seed=5)  # two groups of four, then one row
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(5))
        together = quant_cpu.quant_linear(x, weight)  # [1, 9]
        alone = [
            quant_cpu.quant_linear(x, QuantWeight(weight.format, weight.data[r : r + 1], cols))
            for r in range(9)
        ]
    assert_within(together, x, weight, fmt)
    assert torch.equal(together.view(torch.int32), torch.cat(alone, dim=1).view(torch.int32))


@pytest.mark.parametrize("fmt", AVX2_ONLY_FORMATS)
def test_avx512_path_runs_the_avx2_kernels(fmt):
    """Q5_0 and Q5_1 have no AVX-512 code: that path runs their AVX2 functions, so the fused
    paths (1-8 input rows) and the dequantization give the AVX2 path's bits there."""
    if "avx512" not in quant_cpu.supported_isas():
        pytest.skip("this CPU does not run the avx512 path")
    cols = 137 * 32  # long enough for pieces of x at 3-8 rows
    weight = random_weight(fmt, 37, cols, seed=8)
    inputs = [torch.randn(m, cols, generator=torch.Generator().manual_seed(m)) for m in ROWS]
    got = {}
    for path in ("avx2", "avx512"):
        with kernel_settings(isa=path):
            fused = [quant_cpu.quant_linear(x, weight) for x in inputs if x.shape[0] <= 8]
            got[path] = [quant_cpu.dequantize(weight), *fused]
    for a, b in zip(got["avx2"], got["avx512"], strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _weights_of_every_format() -> list[QuantWeight]:
    """40 rows in each block format, then float32 and bfloat16 rows (a long row of 17
    super-blocks or 137 blocks: the rows kernels take x in pieces at several inputs)."""
    weights = []
    for fmt in FORMATS:
        cols = 17 * 256 if FORMATS[fmt].block_values == 256 else 137 * 32
        weights.append(random_weight(fmt, 40, cols, seed=3))
    dense = torch.randn(40, 137 * 32, generator=torch.Generator().manual_seed(3))
    return weights + [float_rows(dense.to(dtype)) for dtype in FLOAT_DTYPES]


@pytest.mark.parametrize("fused_rows", [0, 17])
def test_a_row_has_the_bits_it_has_alone_in_any_batch_up_to_fused_rows(isa, fused_rows):
    """Speculative decoding's verify rows: every output of a batch of 2 to `fused_rows`
    input rows (8 under auto; 17 = 1 + 16 drafts) is bit for bit the output of its input row
    alone, whose one-row product takes the wide kernels. Every format, float32 and bfloat16
    rows included, on every path, under the integer-path choice of a step with drafts."""
    drafts = verify_kernel_settings(applied(), rows=2, drafts=True)
    with kernel_settings(fused_rows=fused_rows, int_dots=drafts.int_dots):
        most = quant_cpu.fused_rows()
        assert most == (fused_rows or 8)
        for weight in _weights_of_every_format():
            x = torch.randn(most, weight.cols, generator=torch.Generator().manual_seed(most))
            alone = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(most)])
            for m in range(2, most + 1):
                got = quant_cpu.quant_linear(x[:m], weight)
                assert torch.equal(got.view(torch.int32), alone[:m].view(torch.int32)), (
                    f"{weight.format.name}: {m} rows"
                )


@pytest.mark.parametrize("rows", [3, 64])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quant_linear_strided_input_rows(isa, fmt, rows):
    cols = _cols(fmt)
    weight = random_weight(fmt, 45, cols, seed=2)
    wide = torch.randn(2 * rows, cols + 40, generator=torch.Generator().manual_seed(3))
    x = wide[::2, 8 : 8 + cols]  # rows 2 * (cols + 40) apart, not contiguous
    assert not x.is_contiguous()
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, fmt)


@pytest.fixture(params=["blas", "native", "tiles"])
def gemm(request):
    """Each GEMM of the panel path in turn (the native one on every ISA path: the portable
    loop where the CPU lacks AVX-512), with AMX's tiles off; then the tiles, on CPUs with AMX,
    for TILES_FORMATS (the others keep the float32 panels). "auto" again afterwards."""
    if request.param == "tiles" and not _tiles_run():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    if request.param == "tiles":
        with kernel_settings(tiles="on"):
            assert quant_cpu.tiles()
            yield request.param
    else:
        with kernel_settings(tiles="off", gemm=request.param):
            assert quant_cpu.gemm() == request.param and not quant_cpu.tiles()
            yield request.param


def _tiles_run() -> bool:
    """Whether AMX's tiles run here: granted, on a CPU with AVX-512."""
    return quant_cpu.bf16_tiles() and "avx512" in quant_cpu.supported_isas()


# a scale per 32 values, or Q6_K's 8-bit scales in the weights; not Q5_0/1
TILES_FORMATS = ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"]


def _tiles_and_panels(x: torch.Tensor, weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_linear with the tiles on, then off."""
    with kernel_settings(tiles="on"):
        tiles = quant_cpu.quant_linear(x, weight)
    with kernel_settings(tiles="off"):
        panels = quant_cpu.quant_linear(x, weight)
    return tiles, panels


@pytest.mark.parametrize("rows", [9, 16, 31, 33, 64, 300])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_panel_gemms_match_float64(isa, gemm, fmt, rows):
    """Token counts around the native GEMM's 32-token strips (9, 16 and the last strips of 33
    and 300: at most 16 tokens, the half micro-kernel); 37 and 45 outputs: not whole 12-row
    micro-blocks."""
    cols = _cols(fmt)
    weight = random_weight(fmt, 37, cols, seed=rows)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, fmt)
    wide = torch.randn(2 * rows, cols + 40, generator=torch.Generator().manual_seed(3))
    strided = wide[::2, 8 : 8 + cols]
    weight = random_weight(fmt, 45, cols, seed=2)
    assert_within(quant_cpu.quant_linear(strided, weight), strided, weight, fmt)


@pytest.mark.parametrize(("few", "many"), [(12, 20), (37, 52)])
@pytest.mark.parametrize("fmt", ["q4_0", "q6_k"])
def test_a_strip_of_16_tokens_sums_as_a_full_strip(isa, gemm, fmt, few, many):
    """A last strip of at most 16 tokens takes the half micro-kernel (on AVX2, one of at most 8
    a quarter kernel: the 5 tokens after 32): its sums are those of the same tokens in a full
    strip, bit for bit (batched decode must not depend on the batch size). The native GEMM
    only: a BLAS's or AMX's sums may follow the size."""
    if gemm != "native":
        pytest.skip("bit-for-bit across sizes is the native GEMM's promise")
    cols = _cols(fmt)
    weight = random_weight(fmt, 40, cols, seed=5)
    x = torch.randn(many, cols, generator=torch.Generator().manual_seed(6))
    part = quant_cpu.quant_linear(x[:few].contiguous(), weight)  # last strip: 12 or 5 tokens
    full = quant_cpu.quant_linear(x, weight)  # last strip: 20 tokens
    assert torch.equal(part, full[:few])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_panel_gemms_float_rows(isa, gemm, dtype):
    """float32 rows multiply in place (no panel copy), bfloat16 rows widened into panels."""
    dense = torch.randn(50, 736, generator=torch.Generator().manual_seed(7)).to(dtype)
    weight = float_rows(dense)
    x = torch.randn(70, 736, generator=torch.Generator().manual_seed(8))
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, weight.format.name)


def test_native_gemm_into_a_column_slice(gemm):
    weight = random_weight("q4_1", 30, 96)
    x = torch.randn(40, 96)
    out = torch.full((40, 50), float("nan"))
    quant_cpu.quant_linear(x, weight, out[:, 12:42])
    assert torch.isnan(out[:, :12]).all() and torch.isnan(out[:, 42:]).all()
    assert_within(out[:, 12:42], x, weight, "q4_1")


@pytest.mark.parametrize("rows", [12, 40])
def test_native_gemm_adds_the_chunks_of_k_in_order(isa, gemm, rows):
    """Each sum is its 64-value chunks' sums added one after another, over all of k, however the
    sweep blocks k for the caches: a 1e8 first chunk then chunks summing to 3 stay at 1e8 in
    float32 (each 3 rounds away), where blocks of 256 values summed apart (12, then 1e8 + 12)
    would not. 12 tokens take the half micro-kernel, 40 a full strip and a half."""
    if gemm != "native":
        pytest.skip("the order of the sums is the native GEMM's promise")
    k = 768
    weight = float_rows(torch.ones(5, k))
    x = torch.zeros(rows, k)
    x[:, 0] = 1e8
    x[:, 64 + 5 :: 64] = 3.0  # one 3 in each later chunk
    got = quant_cpu.quant_linear(x, weight)
    assert torch.equal(got, torch.full((rows, 5), 1e8))


def test_gemm_auto_follows_the_cpu():
    """Native where the path is AVX-512 or AVX2 on a CPU that is not Intel's (MKL runs its
    AVX-512 code on Intel's only, and its AVX2 code was the slower there), torch's sgemm
    elsewhere."""
    native = quant_cpu.isa() in ("avx512", "avx2") and _vendor() != "GenuineIntel"
    want = "native" if native else "blas"
    assert quant_cpu.gemm() == want
    with kernel_settings(isa="portable"):
        assert quant_cpu.gemm() == "blas"
    with pytest.raises(ValueError, match="gemm"):
        with kernel_settings(gemm="mkl"):
            pass


def test_gemm_auto_takes_long_rows_natively_on_intel():
    """On an Intel CPU's AVX-512 path MKL's sgemm takes prefill's panels of rows shorter than
    2048 values, the native kernel those of 2048 or more (MKL falls behind there): under
    auto, 160 input rows of a Q4_0 weight (past batched decode's 32-128, which the native
    kernel takes at any k) have the bits of gemm=blas at k = 1536 and of gemm=native at
    k = 2048 (the two kernels sum in different orders)."""
    if _vendor() != "GenuineIntel" or quant_cpu.isa() != "avx512" or quant_cpu.gemm() != "blas":
        pytest.skip("the rule is for Intel's AVX-512 path with torch's sgemm")
    for cols, want in ((1536, "blas"), (2048, "native")):
        weight = random_weight("q4_0", 40, cols, seed=6)
        x = torch.randn(160, cols, generator=torch.Generator().manual_seed(6))
        with kernel_settings(tiles="off"):
            auto = quant_cpu.quant_linear(x, weight)
        outs = {}
        for gemm in ("blas", "native"):
            with kernel_settings(tiles="off", gemm=gemm):
                outs[gemm] = quant_cpu.quant_linear(x, weight)
        assert not torch.equal(outs["blas"], outs["native"])  # else the test shows nothing
        assert torch.equal(auto, outs[want]), (cols, want)


def _linear_parts(x: torch.Tensor, parts: list[QuantWeight]) -> torch.Tensor:
    """The C entry point of a projection in parts (the layer program's), outputs side by side."""
    import ctypes

    lib = quant_cpu.library()
    n = len(parts)
    y = torch.full((x.shape[0], sum(p.rows for p in parts)), float("nan"))
    status = lib.pagecli_quant_linear_parts(
        n,
        (ctypes.c_int * n)(*[p.format.ggml_type for p in parts]),
        (ctypes.c_void_p * n)(*[p.data.data_ptr() for p in parts]),
        (ctypes.c_int64 * n)(*[p.rows for p in parts]),
        ctypes.c_int64(x.shape[1]),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(x.shape[1]),
        ctypes.c_int64(x.shape[0]),
        ctypes.c_void_p(y.data_ptr()),
        ctypes.c_int64(y.shape[1]),
        torch.get_num_threads(),  # as quant_cpu.quant_linear: the panels split by it
    )
    assert status == 0
    return y


@pytest.mark.parametrize("rows", [5, 40, 100])
def test_a_projection_in_parts_has_each_parts_bits(isa, gemm, rows):
    """Parts of one projection in three formats (a Q4_K_M file's q/k/v of Q4_K beside Q6_K),
    and float32 rows: through pagecli_quant_linear_parts, which packs x once and takes every
    part's panels in one parallel region, each column has the bits of its part alone (fails
    when a part's panels land in another part's columns, or a panel reads another part's
    format: checked), at a batch of the fused kernels and past it."""
    cols = 768
    gen = torch.Generator().manual_seed(9)
    parts = [random_weight("q4_k", 70, cols, seed=1), random_weight("q6_k", 33, cols, seed=2)]
    parts += [random_weight("q8_0", 20, cols, seed=3)]
    parts += [float_rows(torch.randn(17, cols, generator=gen))]
    x = torch.randn(rows, cols, generator=gen)
    got = _linear_parts(x, parts)
    alone = torch.cat([quant_cpu.quant_linear(x, p) for p in parts], dim=1)
    assert torch.equal(got, alone)


@pytest.mark.parametrize("fmt", ["q4_1", "q6_k"])
def test_many_rows_without_panels_take_the_fused_path(isa, fmt):
    cols = _cols(fmt)
    weight = random_weight(fmt, 21, cols, seed=4)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(4))
    with kernel_settings(gemm="off", tiles="off"):
        assert quant_cpu.gemm() is None
        got = quant_cpu.quant_linear(x, weight)
    assert_within(got, x, weight, fmt)


def test_tiles_auto_follows_the_cpu():
    """On the AVX-512 path of a CPU with AMX that Linux grants; never on the other paths under
    "auto"; "on" refused where the tiles cannot run."""
    assert quant_cpu.tiles() == (quant_cpu.isa() == "avx512" and quant_cpu.bf16_tiles())
    with kernel_settings(isa="portable"):
        assert not quant_cpu.tiles()
    with pytest.raises(ValueError, match="tiles"):
        with kernel_settings(tiles="amx"):
            pass
    if not _tiles_run():
        with pytest.raises(ValueError, match="not available on this CPU"):
            with kernel_settings(tiles="on"):
                pass
        assert not quant_cpu.tiles()
        return
    with kernel_settings(tiles="on"):
        assert quant_cpu.tiles()
    with kernel_settings(tiles="off"):
        assert not quant_cpu.tiles()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiles_take_their_formats(fmt):
    """With the tiles on, those formats' batches sum in another order than the float32 panels
    (so some output differs in its last bits: the tiles ran); Q5_0's and Q5_1's (no split for
    the tiles) and the IQ4/MXFP4 formats' do not change. 800 outputs: several panels per
    thread."""
    if not _tiles_run():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    cols = _cols(fmt)
    weight = random_weight(fmt, 800, cols, seed=6)
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(6))
    tiles, panels = _tiles_and_panels(x, weight)
    assert torch.equal(tiles, panels) == (fmt not in TILES_FORMATS)
    assert_within(tiles, x, weight, fmt)


@pytest.mark.parametrize("fmt", TILES_FORMATS)
def test_tiles_take_long_rows_in_pieces(fmt):
    """The tiles take k in pieces of at most 2048 values a row (1024 past two 32-token strips),
    each piece going on from the last one's totals: 21 super-blocks' worth of values make 3
    pieces of 1792 at 9 and 40 tokens and 6 at 100 (896 values each; the K-quants' whole
    super-blocks: five of 1024 and one of 256), over 70 rows (a part micro-block) and part
    strips. Within tolerance of float64, and a token's outputs have the same bits in a batch
    of 9, 40 or 100 and at one thread or two: the pieces do not change the sums."""
    if not _tiles_run():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    cols = 21 * 256
    weight = random_weight(fmt, 70, cols, seed=8)
    x = torch.randn(100, cols, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    try:
        with kernel_settings(tiles="on"):
            torch.set_num_threads(2)
            most = quant_cpu.quant_linear(x, weight)
            many = quant_cpu.quant_linear(x[:40], weight)
            torch.set_num_threads(1)
            few = quant_cpu.quant_linear(x[:9], weight)
    finally:
        torch.set_num_threads(threads)
    assert_within(most, x, weight, fmt)
    assert torch.equal(many, most[:40])
    assert torch.equal(few, most[:9])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_tiles_keep_every_bit_of_the_input(fmt):
    """Row r of W is 1.0 at column r and 0 elsewhere (f16 scale 1, offset 0), so y = x[:, :32]
    exactly, whatever the summation order: only if all three bfloat16 parts of each float32
    input value reach the sums (x with full 24-bit significands, some of them near 2^-100;
    below 2^-103 the lowest part can be denormal, which TDPBF16PS takes as zero)."""
    if not _tiles_run():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    f = FORMATS[fmt]
    data = np.zeros((32, f.block_bytes), dtype=np.uint8)
    data[:, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    for r in range(32):
        if fmt == "q8_0":
            data[r, 2 + r] = 1
        else:  # Q4_1: d, m, then value j in the low nibble of byte j, j + 16 in the high one
            data[r, 4 + r % 16] = 1 << (4 * (r // 16))
    weight = QuantWeight(f, torch.from_numpy(data), 32)
    gen = torch.Generator().manual_seed(5)
    significand = 1 + torch.rand(40, 32, generator=gen, dtype=torch.float64)  # [1, 2)
    sign = torch.randint(0, 2, (40, 32), generator=gen) * 2 - 1
    exponent = torch.randint(-3, 4, (40, 32), generator=gen)
    exponent[:8] = -100
    x = (sign * significand * 2.0**exponent).float()  # 24 significant bits, rounded
    assert (x.view(torch.int32) & 0xFF).count_nonzero() > 1000  # lowest part non-zero
    got, _ = _tiles_and_panels(x, weight)
    assert torch.equal(got, x), (got - x).abs().max()
    # the same shapes with random blocks: the tiles, not the panels, made `got`
    scrambled = random_weight(fmt, 32, 32, seed=7)
    tiles, panels = _tiles_and_panels(x[8:], scrambled)
    assert not torch.equal(tiles, panels)


def _q6_k_one_value_a_row(values: list[tuple[int, int, int]]) -> QuantWeight:
    """One Q6_K super-block a row (256 columns, d = 2^-10): row r's weight at column col is
    d * sc * (q - 32) for values[r] = (col, sc, q), every other weight of the row 0 (q = 32)."""
    f = FORMATS["q6_k"]
    data = np.zeros((len(values), f.block_bytes), dtype=np.uint8)
    data[:, 128:192] = 0xAA  # every 2-bit high field 2, low nibbles 0: q = 32
    data[:, 208:210] = np.frombuffer(np.float16(2.0**-10).tobytes(), dtype=np.uint8)
    for r, (col, sc, q) in enumerate(values):
        half, j = divmod(col, 128)
        group, lane = divmod(j, 32)  # ql byte lane (+32 for groups 1, 3), nibble group // 2
        ql = 64 * half + lane + 32 * (group & 1)
        data[r, ql] |= (q & 0xF) << (4 * (group >> 1))
        qh = 128 + 32 * half + lane
        keep = 0xFF ^ (3 << (2 * group))
        data[r, qh] = (int(data[r, qh]) & keep) | ((q >> 4) << (2 * group))
        data[r, 192 + 8 * half + j // 16] = np.uint8(sc & 0xFF)  # int8
    return QuantWeight(f, torch.from_numpy(data), 256)


def test_tiles_keep_every_bit_of_q6_k_weights():
    """Row r of W holds one weight, d * sc * (q - 32) with 10-12 significant bits in
    sc * (q - 32), so neither bfloat16 part of the weight alone is it; x has 11 significant
    bits, so each product x * w and any sum of its parts' products is exact in float32: y is
    x * w exactly, and only if both parts of the weight and all parts of x reach the sums."""
    if not _tiles_run():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    scales = [127, -127, 93, -115, 101, 77, -89, 125]
    qs = [1, 63, 3, 61, 50, 13, 0, 44]  # q - 32: -31, 31, -29, 29, 18, -19, -32, 12
    values = [(8 * r, scales[r % 8], qs[(r * 3) % 8]) for r in range(32)]
    weight = _q6_k_one_value_a_row(values)
    dense = quant_cpu.dequantize(weight).double()
    want_w = torch.zeros(32, 256, dtype=torch.float64)
    for r, (col, sc, q) in enumerate(values):
        want_w[r, col] = 2.0**-10 * sc * (q - 32)
    assert torch.equal(dense, want_w)  # the blocks hold what the test means
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(1 << 10, 1 << 11, (40, 256), generator=gen).double()  # 11 bits
    x = (
        x
        * (torch.randint(0, 2, (40, 256), generator=gen) * 2 - 1)
        * 2.0 ** torch.randint(-20, -5, (40, 256), generator=gen)
    )
    x = x.float()
    got, panels = _tiles_and_panels(x, weight)
    want = (x.double() @ want_w.T).float()  # one product a row: exact in float32
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(panels, want)
    # the same shapes with random blocks: the tiles, not the panels, made `got`
    scrambled = random_weight("q6_k", 32, 256, seed=7)
    tiles, panels = _tiles_and_panels(x, scrambled)
    assert not torch.equal(tiles, panels)


# float32 rows through the same drivers (quant_formats.F32): float weights of safetensors
# checkpoints take these kernels on the CPU. Exact weights, so only the summation differs.
# bfloat16 rows (quant_formats.BF16) likewise: widening a bfloat16 to float32 is exact.
TOLERANCES["float32"] = TOLERANCES["bfloat16"] = 2e-6


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_float_rows_match_float64(isa, rows, dtype):
    dense = torch.randn(37, 736, generator=torch.Generator().manual_seed(rows)).to(dtype)
    weight = float_rows(dense)
    assert weight.format.name == str(dtype).removeprefix("torch.")
    assert weight.data.data_ptr() == dense.data_ptr()  # a view, no copy
    x = torch.randn(rows, 736, generator=torch.Generator().manual_seed(rows + 1))
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, weight.format.name)
    assert torch.equal(quant_cpu.dequantize(weight), dense.float())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_float_rows_strided_input_rows(isa, rows, dtype):
    dense = torch.randn(45, 736, generator=torch.Generator().manual_seed(5)).to(dtype)
    weight = float_rows(dense)
    wide = torch.randn(2 * rows, 776, generator=torch.Generator().manual_seed(6))
    x = wide[::2, 8:744]
    assert_within(quant_cpu.quant_linear(x, weight), x, weight, weight.format.name)


def test_float_rows_need_whole_blocks():
    with pytest.raises(ValueError, match="whole"):
        float_rows(torch.zeros(4, 40))
    with pytest.raises(ValueError, match="whole"):
        float_rows(torch.zeros(4, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        float_rows(torch.zeros(4, 64, dtype=torch.float16))


def test_output_into_a_column_slice():
    weight = random_weight("q8_0", 16, 64)
    x = torch.randn(9, 64)
    out = torch.full((9, 40), float("nan"))
    quant_cpu.quant_linear(x, weight, out[:, 12:28])
    assert torch.isnan(out[:, :12]).all() and torch.isnan(out[:, 28:]).all()
    assert_within(out[:, 12:28], x, weight, "q8_0")


def test_panel_path_found_torch_blas():
    assert quant_cpu.has_blas(), "torch's sgemm_ was not found: prefill would be slow"


def test_row_id_out_of_range_is_an_error():
    weight = random_weight("q4_0", 5, 32)
    with pytest.raises(ValueError, match="row id"):
        quant_cpu.dequantize(weight, torch.tensor([0, 5]))


def test_columns_must_be_whole_blocks():
    with pytest.raises(ValueError, match="whole"):
        QuantWeight(FORMATS["q4_k"], torch.zeros(2, 144, dtype=torch.uint8), 200)


def _vendor() -> str:
    with open("/proc/cpuinfo") as info:
        vendors = (line.split(":")[1].strip() for line in info if line.startswith("vendor_id"))
        return next(vendors, "")


def _family() -> int:
    with open("/proc/cpuinfo") as info:
        found = (line.split(":")[1] for line in info if line.startswith("cpu family"))
        return int(next(found, "0"))


def test_prefetch_default_follows_the_cpu():
    """The L2 on AMD CPUs before Zen 5 (family 0x1A), the L1 elsewhere."""
    if not _vendor():
        pytest.skip("/proc/cpuinfo names no vendor")
    want = "l2" if _vendor() == "AuthenticAMD" and _family() < 0x1A else "l1"
    with kernel_settings(prefetch="l1" if want == "l2" else "l2"):
        assert quant_cpu.prefetch() != want
    assert quant_cpu.prefetch() == want


def test_prefetch_levels_change_no_result(isa):
    """The batch-1 kernels (every format, float rows too) give the same bits either way."""
    weights = [random_weight(fmt, 41, _cols(fmt), seed=3) for fmt in FORMATS]
    weights += [float_rows(torch.randn(41, 736, dtype=dtype)) for dtype in FLOAT_DTYPES]
    inputs = [torch.randn(1, w.cols, generator=torch.Generator().manual_seed(9)) for w in weights]
    outs = {}
    for level in ("l1", "l2"):
        with kernel_settings(prefetch=level):
            assert quant_cpu.prefetch() == level
            outs[level] = [quant_cpu.quant_linear(x, w) for x, w in zip(inputs, weights)]
    for x, w, a, b in zip(inputs, weights, outs["l1"], outs["l2"]):
        assert torch.equal(a, b), w.format.name
        assert_within(b, x, w, w.format.name)


def test_prefetch_level_must_be_known():
    with pytest.raises(ValueError, match="prefetch"):
        with kernel_settings(prefetch="l3"):
            pass


# bfloat16 inputs with bfloat16 weights (quant_cpu.bf16_linear, csrc/gemm_bf16.c): exact
# products, float32 sums; the row kernels up to 8 rows, then AMX's tiles ("tiles", CPUs with
# AMX), the pair GEMM ("pairs": VDPBF16PS on the AVX-512 path of a CPU with AVX512_BF16, its
# portable loop on the other paths) or the float32 panels on the widened input ("float32",
# and "off" when called anyway).
@pytest.fixture(params=["tiles", "pairs", "float32", "off"])
def bf16_gemm(request):
    if request.param == "tiles" and not quant_cpu.bf16_tiles():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    with kernel_settings(bf16_gemm=request.param):
        assert quant_cpu.bf16_gemm() == request.param
        yield request.param


@pytest.mark.parametrize("rows", [*ROWS, 9, 31, 33])
def test_bf16_linear_matches_float64(isa, bf16_gemm, rows):
    """Token counts around the 32-token strips; 37 and 45 outputs: not whole 12-row (pairs) or
    32-row (tiles) micro-blocks, so the tiles' last one reads W's rows from a padded copy."""
    gen = torch.Generator().manual_seed(rows)
    weight = float_rows(torch.randn(37, 736, generator=gen).bfloat16())
    x = torch.randn(rows, 736, generator=gen).bfloat16()
    got = quant_cpu.bf16_linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, 37)
    assert_within(got, x.float(), weight, "bfloat16")
    wide = torch.randn(2 * rows, 776, generator=gen).bfloat16()
    strided = wide[::2, 8:744]  # rows 1552 values apart
    weight = float_rows(torch.randn(45, 736, generator=gen).bfloat16())
    assert_within(quant_cpu.bf16_linear(strided, weight), strided.float(), weight, "bfloat16")


@pytest.mark.parametrize("path", ["portable", "avx512"])
def test_bf16_pairs_sum_in_the_documented_order(path):
    """Each pair adds its odd product, then its even one, to the running float32 sum (Intel's
    description of VDPBF16PS; the portable loop is written so). After a first pair that sums
    to 1, the pair (2^-24, -1) gives 2^-24 in that order, and 0 the other way round (1 +
    2^-24 rounds to 1)."""
    if path == "avx512" and not quant_cpu.bf16_gemm_native():
        pytest.skip("this CPU has no AVX512_BF16")
    with kernel_settings(isa=path, bf16_gemm="pairs"):
        x = torch.zeros(9, 32, dtype=torch.bfloat16)  # 9 rows: the pair GEMM
        w = torch.zeros(1, 32, dtype=torch.bfloat16)
        x[:, :4] = torch.tensor([1.0, 0.0, 2.0**-24, -1.0])  # pairs (x0, x1), (x2, x3)
        w[0, :4] = 1.0
        got = quant_cpu.bf16_linear(x, float_rows(w))
    assert (got == 2.0**-24).all(), got[:, 0]


def test_bf16_gemm_auto_follows_the_cpu():
    """On the AVX-512 path: AMX's tiles where the CPU has them (and Linux grants them), else
    the pair GEMM where it has AVX512_BF16 and no AMX; on the AVX2 path the float32 panels;
    torch's GEMM elsewhere."""
    flags = _flags()
    native = quant_cpu.isa() == "avx512" and "avx512_bf16" in flags
    tiles = quant_cpu.bf16_tiles()
    assert not tiles or {"amx_bf16", "amx_tile"} <= flags
    assert quant_cpu.bf16_gemm_native() == native
    amx = {"amx_bf16", "amx_tile"} <= flags  # usable by torch's oneDNN where not by us
    want = "tiles" if tiles and quant_cpu.isa() == "avx512" else "off"
    if want == "off" and native and not amx:
        want = "pairs"
    if quant_cpu.isa() == "avx2":
        want = "float32"
    assert quant_cpu.bf16_gemm() == want
    with kernel_settings(isa="portable"):
        assert quant_cpu.bf16_gemm() == "off" and not quant_cpu.bf16_gemm_native()
    if quant_cpu.isa() in ("avx2", "avx512"):
        with kernel_settings(isa="avx2"):
            assert quant_cpu.bf16_gemm() == "float32" and not quant_cpu.bf16_gemm_native()
    with pytest.raises(ValueError, match="bf16_gemm"):
        with kernel_settings(bf16_gemm="amx"):
            pass
    if not tiles:
        with pytest.raises(ValueError, match="not available on this CPU"):
            with kernel_settings(bf16_gemm="tiles"):
                pass
        assert quant_cpu.bf16_gemm() == want


def _flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_bf16_linear_takes_bfloat16_only():
    weight = float_rows(torch.zeros(4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        quant_cpu.bf16_linear(torch.zeros(2, 32), weight)
    with pytest.raises(ValueError, match="bfloat16"):
        quant_cpu.bf16_linear(
            torch.zeros(2, 32, dtype=torch.bfloat16), float_rows(torch.zeros(4, 32))
        )


# ---- the integer paths (csrc/quant_k.c, quant_q4_q8.c: x split into two int16 parts;
# AVX-512 VNNI at batch 1, or at any batch up to fused_rows when on; AVX2 at any batch for
# Q4_K, Q5_K and Q6_K, and for Q4_0 and Q4_1 when on) ----

INT_FORMATS = ["q4_k", "q6_k", "q5_k", "q4_0", "q4_1"]


def _int_path_for(path: str, fmt: str) -> None:
    """Skip where `path` (the `int_dots` fixture's) has no integer kernel for `fmt`."""
    if fmt not in quant_cpu.INT_DOTS_FORMATS and not path.startswith("avx2"):
        pytest.skip(f"{fmt} has an integer path on the AVX2 path only")
    if path == "avx2-auto" and fmt not in quant_cpu.INT_DOTS_FORMATS_AVX2_AUTO:
        pytest.skip(f"AVX2's integer path for {fmt} runs under on only")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _int_dots_run() -> bool:
    return "avx512" in quant_cpu.supported_isas() and "avx512_vnni" in _cpu_flags()


@pytest.fixture(params=["avx512", "avx2", "avx2-auto"])
def int_dots(request):
    """An integer path: AVX-512 VNNI's under on, Q4_K's kernels included (skipped where the CPU
    lacks VNNI), AVX2's under on and under auto (Q4_K has other kernels under each); back to
    auto after."""
    isa, _, choice = request.param.partition("-")
    if isa == "avx512" and not _int_dots_run():
        pytest.skip("this CPU has no AVX512_VNNI")
    if isa not in quant_cpu.supported_isas():
        pytest.skip(f"this CPU does not run the {isa} path")
    vnni_q4_k = "on" if isa == "avx512" else "auto"
    with kernel_settings(isa=isa, int_dots=choice or "on", vnni_q4_k=vnni_q4_k):
        yield request.param


def test_int_dots_auto_follows_the_cpu():
    """Under "auto": on the AVX2 path, and on the AVX-512 path of a CPU with AVX512_VNNI;
    never on the portable one; "off" turns it off."""
    isa = quant_cpu.isa()
    assert quant_cpu.int_dots() == (
        isa == "avx2" or (isa == "avx512" and "avx512_vnni" in _cpu_flags())
    )
    with kernel_settings(isa="portable"):
        assert not quant_cpu.int_dots()
    with pytest.raises(ValueError, match="int_dots"):
        with kernel_settings(int_dots="vnni"):
            pass
    with kernel_settings(int_dots="off"):
        assert not quant_cpu.int_dots()
    if "avx2" in quant_cpu.supported_isas():
        with kernel_settings(isa="avx2"):
            assert quant_cpu.int_dots()


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 8, 17])
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_dots_of_several_rows_match_float64_and_each_row_alone(int_dots, fmt, rows):
    """Both integer paths take any number of input rows when on (fused_rows 17 here), each
    with the bits it has alone (the batch-1 kernel's over WIDE_ROWS rows of W on AVX-512
    VNNI, and for Q4_0 and Q4_1 on AVX2), within the float kernels' float64 tolerance."""
    _int_path_for(int_dots, fmt)
    weight = random_weight(fmt, 37, 17 * 256, seed=rows)
    x = torch.randn(rows, 17 * 256, generator=torch.Generator().manual_seed(rows))
    with kernel_settings(fused_rows=17):
        got = quant_cpu.quant_linear(x, weight)
        alone = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(rows)])
        with kernel_settings(int_dots="off"):
            floats = quant_cpu.quant_linear(x, weight)
    assert_within(got, x, weight, fmt)
    assert torch.equal(got.view(torch.int32), alone.view(torch.int32))
    assert not torch.equal(got, floats)  # the integer path ran


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_only_steps_with_drafts_take_vnnis_integer_path_for_several_rows(fmt):
    """Under auto, AVX-512 VNNI's integer path takes batch 1 only (2-8 rows are faster on the
    float kernels); a step with drafts turns it on for every batch, so that its rows have the
    bits they have alone."""
    if not _int_dots_run():
        pytest.skip("this CPU has no AVX512_VNNI")
    weight = random_weight(fmt, 37, 17 * 256, seed=7)
    x = torch.randn(4, 17 * 256, generator=torch.Generator().manual_seed(7))
    with kernel_settings(isa="avx512", vnni_q4_k="on"):  # Q4_K's kernels on Intel's CPUs too
        alone = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(4)])
        assert not torch.equal(quant_cpu.quant_linear(x, weight), alone)  # the float kernels
        drafts = verify_kernel_settings(applied(), rows=4, drafts=True)
        assert drafts.int_dots == "on"
        with kernel_settings(int_dots=drafts.int_dots):
            got = quant_cpu.quant_linear(x, weight)
    assert torch.equal(got.view(torch.int32), alone.view(torch.int32))


def test_vnni_q4_k_follows_the_vendor():
    """Under auto Q4_K takes VNNI's integer kernels on AMD's CPUs only; on Intel's it keeps
    the float kernels (the faster there) at every batch, so under int_dots on its rows have
    the float kernels' bits at 1-17 rows, each as alone. "on" and "off" override; "on" needs
    VNNI. Q6_K takes its integer kernel either way."""
    if not _int_dots_run():
        with pytest.raises(ValueError, match="vnni_q4_k"):
            with kernel_settings(vnni_q4_k="on"):
                pass
        assert not quant_cpu.vnni_q4_k()
        return
    assert quant_cpu.vnni_q4_k() == (_vendor() != "GenuineIntel")
    weight = random_weight("q4_k", 37, 17 * 256, seed=3)
    x = torch.randn(17, weight.cols, generator=torch.Generator().manual_seed(3))
    with kernel_settings(isa="avx512", int_dots="off"):
        floats = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(17)])
    for choice in ("off", "on"):
        with kernel_settings(isa="avx512", int_dots="on", vnni_q4_k=choice, fused_rows=17):
            assert quant_cpu.vnni_q4_k() == (choice == "on")
            assert ("q4_k" in quant_cpu.int_dots_formats()) == (choice == "on")
            assert "q6_k" in quant_cpu.int_dots_formats()
            alone = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(17)])
            for m in (2, 5, 8, 17):
                together = quant_cpu.quant_linear(x[:m], weight)
                assert torch.equal(together.view(torch.int32), alone[:m].view(torch.int32)), m
        assert torch.equal(alone, floats) == (choice == "off")
        assert_within(alone, x, weight, "q4_k")


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
def test_avx2_takes_the_q4_integer_path_under_on_only_at_every_batch(fmt):
    """AVX2's Q4_0 and Q4_1 integer path: under auto the float kernels take every batch, so a
    row has the float bits at 1 row and at 2-8; under on the integer path takes every batch,
    each row with the bits it has alone, and those are not the float kernels'."""
    if "avx2" not in quant_cpu.supported_isas():
        pytest.skip("this CPU does not run the avx2 path")
    weight = random_weight(fmt, 37, 17 * 32 * 8, seed=7)
    x = torch.randn(8, weight.cols, generator=torch.Generator().manual_seed(7))

    def each_alone_and_together():
        alone = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(8)])
        together = [quant_cpu.quant_linear(x[:m], weight) for m in range(2, 9)]
        return alone, together

    with kernel_settings(isa="avx2"):
        assert fmt not in quant_cpu.int_dots_formats()
        floats, together = each_alone_and_together()
        for m, got in enumerate(together, start=2):
            assert torch.equal(got.view(torch.int32), floats[:m].view(torch.int32)), m
        with kernel_settings(int_dots="on"):
            assert fmt in quant_cpu.int_dots_formats()
            ints, together = each_alone_and_together()
        for m, got in enumerate(together, start=2):
            assert torch.equal(got.view(torch.int32), ints[:m].view(torch.int32)), m
    assert not torch.equal(ints, floats)
    assert_within(ints, x, weight, fmt)


def test_avx2_q4_k_takes_other_kernels_under_on():
    """AVX2's Q4_K integer path has two kernels: under auto each weight times its sub-block's
    scale, under on each sub-block's sum scaled in float32 (faster at one row, slower at
    several; csrc/quant_k.c). Each gives a row its bits alone at 1-8 rows, within the float64
    tolerance, and the two differ (so each ran)."""
    if "avx2" not in quant_cpu.supported_isas():
        pytest.skip("this CPU does not run the avx2 path")
    weight = random_weight("q4_k", 37, 3 * 256, seed=11)
    x = torch.randn(8, weight.cols, generator=torch.Generator().manual_seed(11))
    got = {}
    for choice in ("auto", "on"):
        with kernel_settings(isa="avx2", int_dots=choice):
            alone = torch.cat([quant_cpu.quant_linear(x[i : i + 1], weight) for i in range(8)])
            for m in range(2, 9):
                together = quant_cpu.quant_linear(x[:m], weight)
                assert torch.equal(together.view(torch.int32), alone[:m].view(torch.int32)), m
        assert_within(alone, x, weight, "q4_k")
        got[choice] = alone
    assert not torch.equal(got["auto"], got["on"])


@pytest.mark.parametrize("cols", [768, 8192])
@pytest.mark.parametrize("outputs", [1, 3, 37, 301])
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_dots_match_float64(int_dots, fmt, cols, outputs):
    """One input row, through the integer path: within the float32 tolerance of the float64
    product, and not the float kernels' bits (so the path ran)."""
    _int_path_for(int_dots, fmt)
    weight = random_weight(fmt, outputs, cols, seed=outputs)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols + outputs))
    got = quant_cpu.quant_linear(x, weight)
    assert_within(got, x, weight, fmt)
    with kernel_settings(int_dots="off"):
        floats = quant_cpu.quant_linear(x, weight)
    assert_within(floats, x, weight, fmt)
    if outputs >= 37:
        assert not torch.equal(got, floats)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_dots_give_a_row_the_same_bits_in_a_group_or_alone(int_dots, fmt):
    _int_path_for(int_dots, fmt)
    cols = 768
    weight = random_weight(fmt, 9, cols, seed=5)  # two groups of four, then one row
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(5))
    together = quant_cpu.quant_linear(x, weight)
    alone = [
        quant_cpu.quant_linear(x, QuantWeight(weight.format, weight.data[r : r + 1], cols))
        for r in range(9)
    ]
    assert torch.equal(together.view(torch.int32), torch.cat(alone, dim=1).view(torch.int32))


@pytest.mark.parametrize("fmt", INT_FORMATS)
@pytest.mark.parametrize("magnitude", [1e-36, 1e-12, 1.0, 1e12, 1e30])
def test_int_dots_keep_the_input_at_any_magnitude(int_dots, fmt, magnitude):
    """Super-blocks whose values differ by many orders of magnitude: each keeps 29 bits
    relative to its own largest value; near float32's limits the float kernels take the call."""
    _int_path_for(int_dots, fmt)
    cols = 768
    weight = random_weight(fmt, 37, cols, seed=9)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(9))
    x[0, 256:512] *= magnitude  # the middle super-block
    x[0, 300] = 0.0
    got = quant_cpu.quant_linear(x, weight)
    assert torch.isfinite(got).all()
    assert_within(got, x, weight, fmt)


@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_int_dots_leave_inf_and_nan_to_the_float_kernels(int_dots, fmt):
    _int_path_for(int_dots, fmt)
    cols = 768
    weight = random_weight(fmt, 8, cols, seed=3)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(3))
    x[0, 17] = float("inf")
    got = quant_cpu.quant_linear(x, weight)
    with kernel_settings(int_dots="off"):
        want = quant_cpu.quant_linear(x, weight)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any() | got.isinf().any()
    x[0, 17] = float("nan")
    assert quant_cpu.quant_linear(x, weight).isnan().all()


@pytest.mark.parametrize("rows", [3, 10])
@pytest.mark.parametrize("fmt", INT_FORMATS)
def test_a_row_the_integer_split_refuses_sends_the_whole_call_to_the_float_kernels(
    int_dots, fmt, rows
):
    """Several rows under on, the last one with an inf (in the second pass of 10): the call's
    every row takes the float kernels, as with int_dots off, none the integer bits."""
    _int_path_for(int_dots, fmt)
    weight = random_weight(fmt, 19, 768, seed=5)
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(5))
    x[-1, 17] = float("inf")
    with kernel_settings(fused_rows=17):
        got = quant_cpu.quant_linear(x, weight)
        with kernel_settings(int_dots="off"):
            want = quant_cpu.quant_linear(x, weight)
    assert torch.equal(got[:-1], want[:-1])
    assert torch.equal(got[-1].isnan(), want[-1].isnan())
