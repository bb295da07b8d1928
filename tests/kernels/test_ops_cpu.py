"""The fast CPU path against the float64 reference, on random paged batches with NaN poison.

The decode and prefill cases run with the native C kernel (pagecli_kernels/native.py, which
the CI machine builds with its C compiler) on each instruction-set path this CPU runs
(portable, AVX2, AVX-512), and with the torch fallback.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_cases import TOLERANCES, assert_close, make_case, poison_before_window

import pagecli_kernels
from pagecli_kernels import cpu, native, reference
from pagecli_kernels.settings import kernel_settings
from tests.sizes import FULL

DTYPES = list(TOLERANCES)


@pytest.fixture(params=[f"native-{name}" for name in native.ISAS] + ["torch"])
def cpu_backend(request):
    """Run the test on each native kernel path this CPU runs, then with the kernel off."""
    if request.param.startswith("native"):
        if native.library() is None:
            pytest.fail(f"the native CPU kernel did not build: {native.unavailable_reason()}")
        name = request.param.removeprefix("native-")
        if name not in native.supported_isas():
            pytest.skip(f"this CPU does not run the {name} path")
        with kernel_settings(isa=name):
            yield request.param
    else:
        with kernel_settings(native=False):
            yield request.param


def _random_lengths(rng: random.Random, num_seqs: int, block_size: int, prefill: bool):
    seq_lens, query_lens = [], []
    for _ in range(num_seqs):
        seq_len = rng.choice([1, block_size - 1, block_size, block_size + 1, rng.randint(1, 40)])
        seq_len = max(seq_len, 1)
        seq_lens.append(seq_len)
        if not prefill:
            query_lens.append(1)
        else:
            # whole prompt, a chunk over a cached prefix, or a single decode token
            query_lens.append(rng.choice([seq_len, rng.randint(1, seq_len), 1]))
    return seq_lens, query_lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_decode_matches_reference(dtype, group, seed, cpu_backend):
    rng = random.Random(seed * 100 + group)
    block_size = rng.choice([1, 4, 16])
    seq_lens, query_lens = _random_lengths(rng, rng.randint(1, 5), block_size, prefill=False)
    case = make_case(
        seq_lens,
        query_lens,
        block_size=block_size,
        num_kv_heads=rng.choice([1, 2]),
        group=group,
        head_dim=rng.choice([8, 64]),
        dtype=dtype,
        seed=seed,
    )
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    expected = reference.paged_decode_attention(*args)
    assert_close(cpu.paged_decode_attention(*args), expected)
    assert_close(pagecli_kernels.paged_decode_attention(*args), expected)  # auto -> cpu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_prefill_matches_reference(dtype, group, seed, cpu_backend):
    rng = random.Random(seed * 100 + group + 7)
    block_size = rng.choice([4, 8])
    seq_lens, query_lens = _random_lengths(rng, rng.randint(1, 4), block_size, prefill=True)
    case = make_case(
        seq_lens,
        query_lens,
        block_size=block_size,
        num_kv_heads=rng.choice([1, 2]),
        group=group,
        head_dim=rng.choice([8, 64]),
        dtype=dtype,
        seed=seed,
    )
    args = (
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    expected = reference.paged_prefill_attention(*args)
    assert_close(cpu.paged_prefill_attention(*args), expected)
    assert_close(pagecli_kernels.paged_prefill_attention(*args, impl="cpu"), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 3, 4, 9, None])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_and_sinks_match_reference(dtype, window, with_sinks, cpu_backend):
    # decodes and prefill chunks over prefixes longer than the window; every position no new
    # token sees is NaN, so reading outside the window fails
    rng = random.Random((window or 0) * 10 + with_sinks)
    seq_lens = [1, 4, 13, 23, 40, 17]
    query_lens = [1, 1, 13, 6, 1, 2]
    case = make_case(
        seq_lens, query_lens, block_size=4, num_kv_heads=2, group=3, head_dim=16, dtype=dtype
    )
    if window is not None:
        poison_before_window(case, window)
    sinks = None
    if with_sinks:  # large and small against the scores, so that a misplaced sink shows
        sinks = torch.tensor([rng.uniform(-3.0, 3.0) for _ in range(6)], dtype=torch.float32)
    extra = {"window": window, "sinks": sinks}
    prefill = (case.block_tables, case.seq_lens, case.query_start_loc, case.scale)
    expected = reference.paged_prefill_attention(
        case.query, case.k_cache, case.v_cache, *prefill, **extra
    )
    assert_close(
        cpu.paged_prefill_attention(case.query, case.k_cache, case.v_cache, *prefill, **extra),
        expected,
    )
    decodes = [i for i, n in enumerate(query_lens) if n == 1]
    rows = torch.tensor(decodes)
    tokens = case.query_start_loc[rows].long()
    args = (case.query[tokens], case.k_cache, case.v_cache, case.block_tables[rows])
    args += (case.seq_lens[rows], case.scale)
    expected = reference.paged_decode_attention(*args, **extra)
    assert_close(cpu.paged_decode_attention(*args, **extra), expected)
    assert_close(pagecli_kernels.paged_decode_attention(*args, **extra), expected)


@pytest.mark.parametrize("window", [5, 40, None])
@pytest.mark.parametrize("split_tokens", [4, 16])
def test_native_split_k_with_window_and_sinks(window, split_tokens, native_isa):
    # split-K: the splits cover the window only, and the sink enters the combine once
    case = make_case(
        [133, 60, 1, 97],
        [1, 20, 1, 7],
        block_size=4,
        num_kv_heads=2,
        group=4,
        head_dim=32,
        dtype=torch.float32,
        seed=split_tokens,
    )
    if window is not None:
        poison_before_window(case, window)
    sinks = torch.linspace(-2.0, 2.0, 8)
    args = (
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    expected = reference.paged_prefill_attention(*args, window=window, sinks=sinks)
    got = native.paged_attention(
        *args, max_seq_len=133, split_tokens=split_tokens, window=window, sinks=sinks
    )
    assert_close(got, expected)


@pytest.mark.parametrize("window", [0, -2, 2.5, True])
def test_bad_window_raises(window):
    case = make_case(
        [3], [1], block_size=4, num_kv_heads=1, group=1, head_dim=8, dtype=torch.float32
    )
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="window"):
        pagecli_kernels.paged_decode_attention(*args, window=window)


def test_sinks_of_the_wrong_shape_raise():
    case = make_case(
        [3], [1], block_size=4, num_kv_heads=1, group=2, head_dim=8, dtype=torch.float32
    )
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    for impl in ("cpu", "reference"):
        with pytest.raises(ValueError, match="sinks must be"):
            pagecli_kernels.paged_decode_attention(*args, sinks=torch.zeros(3), impl=impl)


def test_prefill_mixed_batch_with_prefix_and_decodes(cpu_backend):
    # a fresh prompt, a chunk over a 9-token prefix, and two decodes, in one call
    case = make_case(
        [7, 14, 5, 1],
        [7, 5, 1, 1],
        block_size=4,
        num_kv_heads=2,
        group=3,
        head_dim=16,
        dtype=torch.float32,
    )
    args = (
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    expected = reference.paged_prefill_attention(*args)
    assert_close(cpu.paged_prefill_attention(*args), expected)


def test_prefill_single_tokens_equal_decode(cpu_backend):
    case = make_case(
        [3, 9, 4], [1, 1, 1], block_size=4, num_kv_heads=1, group=4, head_dim=8, dtype=torch.float32
    )
    prefill = cpu.paged_prefill_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    decode = cpu.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale
    )
    torch.testing.assert_close(prefill, decode)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 12])
@pytest.mark.parametrize("group", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_decode_at_model_sizes(head_dim, group, dtype, cpu_backend):
    # long contexts over 16-token blocks, lengths off the block boundaries, as the engine runs
    # them; head_dim 12 takes the kernel's scalar (non multiple of 8) loops. On AVX-512,
    # bfloat16 caches with groups under 8 and head_dim a multiple of 32 take the pair path
    # (rows 4 at a time for the scores, 3 for the values: group 7 leaves partial sets)
    rng = random.Random(head_dim * 10 + group)
    seq_lens = [1, 15, 16, 17, 255] + [rng.randint(1, 600) for _ in range(5)]
    case = make_case(
        seq_lens,
        [1] * len(seq_lens),
        block_size=16,
        num_kv_heads=3,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        seed=group,
    )
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(cpu.paged_decode_attention(*args), reference.paged_decode_attention(*args))


@pytest.fixture(params=native.ISAS)
def native_isa(request):
    """Run the test on each native kernel path this CPU runs."""
    if native.library() is None:
        pytest.fail(f"the native CPU kernel did not build: {native.unavailable_reason()}")
    if request.param not in native.supported_isas():
        pytest.skip(f"this CPU does not run the {request.param} path")
    with kernel_settings(isa=request.param):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_tokens", [4, 16, 48])
def test_native_split_k_matches_reference(dtype, split_tokens, native_isa):
    # decodes and prefill chunks over a prefix with contexts cut into splits (split-K); some
    # splits of a chunk lie wholly past its first tokens' causal limit
    case = make_case(
        [1, 15, 70, 133, 40, 64],
        [1, 1, 1, 30, 40, 17],
        block_size=16,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=dtype,
        seed=split_tokens,
    )
    args = (
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    expected = reference.paged_prefill_attention(*args)
    got = native.paged_attention(*args, max_seq_len=133, split_tokens=split_tokens)
    assert_close(got, expected)


def test_native_splits_long_single_sequences():
    # one long sequence on two threads has too few items: the kernel cuts its context
    assert native.choose_split_tokens(3, 2048, 2) == native.SPLIT_TOKENS
    assert native.choose_split_tokens(192, 300, 2) == 0  # 64 sequences decoding
    assert native.choose_split_tokens(3, 2048, 1) == 0  # one thread: nothing to balance
    assert native.choose_split_tokens(3, native.SPLIT_TOKENS, 2) == 0  # one split: none
    # a sequence's rows count once: its k + 1 verify rows share its block table
    tables = torch.tensor([[7, 3], [7, 3], [7, 3], [2, 9]], dtype=torch.int32)
    assert native.distinct_sequences(tables) == 2
    assert native.distinct_sequences(tables[:1]) == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_prefill_at_model_sizes(dtype, native_isa):
    # a 300-token prompt in one chunk and a 100-token chunk over a 200-token prefix, 9 query
    # heads over 3 kv heads, head_dim 64, 16-token blocks: slices of query tokens cross blocks
    case = make_case(
        [300, 300, 1],
        [300, 100, 1],
        block_size=16,
        num_kv_heads=3,
        group=3,
        head_dim=64,
        dtype=dtype,
        seed=5,
    )
    args = (
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )
    assert_close(cpu.paged_prefill_attention(*args), reference.paged_prefill_attention(*args))


def test_native_decode_reads_a_strided_layer_view(cpu_backend):
    # the engine's caches are views of one [2, layers, blocks, ...] tensor
    case = make_case(
        [9, 30, 4],
        [1, 1, 1],
        block_size=8,
        num_kv_heads=2,
        group=3,
        head_dim=64,
        dtype=torch.float32,
    )
    both = torch.stack([case.k_cache, case.v_cache])  # [2, blocks, block_size, heads, D]
    args = (case.query, both[0], both[1], case.block_tables, case.seq_lens, case.scale)
    assert_close(cpu.paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_native_decode_rejects_a_block_id_outside_the_cache():
    case = _tiny_decode(head_dim=64)
    case.block_tables[1, 0] = case.k_cache.shape[0] + 3
    if native.library() is None:
        pytest.fail(f"the native CPU kernel did not build: {native.unavailable_reason()}")
    with pytest.raises(ValueError, match="block id"):
        cpu.paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale
        )


@pytest.fixture
def fresh_native(monkeypatch):
    """The native module as if nothing had tried to build or load the kernel yet."""
    monkeypatch.setattr(
        native,
        "_state",
        {"tried": False, "lib": None, "reason": None, "enabled": True, "isa": None},
    )


def test_native_build_failure_leaves_the_torch_path(fresh_native, monkeypatch, tmp_path):
    # a compiler that fails: no library, a reason, and the op still answers through torch
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PAGECLI_CACHE_DIR", str(tmp_path))
    assert native.library() is None
    assert "failed" in native.unavailable_reason()
    case = _tiny_decode(head_dim=64)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    assert_close(cpu.paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_native_kernel_can_be_turned_off(fresh_native, monkeypatch):
    monkeypatch.setenv("PAGECLI_NATIVE_KERNELS", "0")
    assert native.library() is None
    assert "PAGECLI_NATIVE_KERNELS=0" in native.unavailable_reason()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_store_kv_matches_reference_and_skips_negative_slots(dtype, contiguous):
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if contiguous:
        k_cache = torch.full(shape, float("nan"), dtype=dtype)
        v_cache = torch.full(shape, float("nan"), dtype=dtype)
    else:  # a strided view, like one layer of a [2, ...] cache allocation
        k_cache = torch.full(
            (num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
        )[:, 1]
        v_cache = k_cache.clone()
    key = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    slot_mapping = torch.tensor([13, 0, -1, 7, 19, -5], dtype=torch.int64)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    assert pagecli_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping) is None

    torch.testing.assert_close(k_cache, expected_k, equal_nan=True)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True)
    written = [13, 0, 7, 19]
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[written], key[[0, 1, 3, 4]])
    assert torch.isnan(flat_k).any(dim=(1, 2)).sum() == num_blocks * block_size - len(written)


def _tiny_decode(dtype=torch.float32, head_dim=8):
    return make_case(
        [5, 2], [1, 1], block_size=4, num_kv_heads=2, group=2, head_dim=head_dim, dtype=dtype
    )


@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_bad_dtype_raises(impl):
    case = _tiny_decode()
    q, k, v = case.query.double(), case.k_cache.double(), case.v_cache.double()
    with pytest.raises(ValueError, match="dtype"):
        pagecli_kernels.paged_decode_attention(
            q, k, v, case.block_tables, case.seq_lens, case.scale, impl=impl
        )


def test_bad_impl_raises():
    case = _tiny_decode()
    with pytest.raises(ValueError, match="impl"):
        pagecli_kernels.paged_decode_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            case.scale,
            impl="cuda",
        )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: setattr(c, "block_tables", c.block_tables.long()), "block_tables"),
        (lambda c: setattr(c, "seq_lens", c.seq_lens[:1]), "block_tables has"),
        (lambda c: setattr(c, "query", c.query[:, :3].contiguous()), "multiple"),
        (lambda c: setattr(c, "query", c.query.half()), "dtype"),
        (lambda c: setattr(c, "seq_lens", c.seq_lens * 0), "seq_lens"),
        (lambda c: setattr(c, "v_cache", c.v_cache[:, :2]), "v_cache"),
    ],
)
@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_bad_arguments_raise(mutate, match, impl):
    case = _tiny_decode()
    mutate(case)
    with pytest.raises(ValueError, match=match):
        pagecli_kernels.paged_decode_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.seq_lens,
            case.scale,
            impl=impl,
        )


@pytest.mark.parametrize("context", [40, 253, 300, 700, 2000])
@pytest.mark.parametrize("variant", ["plain", "sinks", "sinks and a window"])
def test_verify_rows_get_the_bits_of_a_decode_alone(context, variant, native_isa):
    """Speculative decoding lays a sequence's k + 1 verify rows out as k + 1 decodes of
    growing length over its one block table. Each row is bit for bit the decode of that row
    alone: the call cuts contexts into splits by its sequences, not its rows (a lone decode
    of a long context on two threads is split; so are the six rows of one sequence), and a
    context of at most SPLIT_TOKENS is one split, which gives the bits of none. With sinks
    (gpt-oss) the first split holds the sink, as the unsplit context does: rows from 253 to
    258 tokens straddle the split size, the first ones unsplit alone and split together."""
    if context == 2000 and variant != "plain" and not FULL:
        pytest.skip("PAGECLI_FULL_TESTS=1 runs it")
    k = 5
    case = make_case(
        [context + k], [1], block_size=16, num_kv_heads=3, group=3, head_dim=64,
        dtype=torch.float32, seed=context,
    )  # fmt: skip
    query = torch.randn(k + 1, 9, 64, generator=torch.Generator().manual_seed(context))
    tables = case.block_tables[:1].repeat(k + 1, 1)
    lens = torch.arange(context, context + k + 1, dtype=torch.int32)

    extra = {}
    if variant != "plain":  # large and small against the scores, as in the tests above
        extra["sinks"] = torch.linspace(-3.0, 3.0, 9)
    if variant == "sinks and a window":
        extra["window"] = 128  # gpt-oss's

    def attend(rows: slice) -> torch.Tensor:
        args = (query[rows], case.k_cache, case.v_cache, tables[rows], lens[rows], 0.125)
        return cpu.paged_decode_attention(*args, **extra)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the splits are for the threads: none with one
    try:
        together = attend(slice(0, k + 1))
        for i in range(k + 1):
            assert torch.equal(together[i : i + 1], attend(slice(i, i + 1))), i
    finally:
        torch.set_num_threads(threads)
    args = (query, case.k_cache, case.v_cache, tables, lens, 0.125)
    assert_close(together, reference.paged_decode_attention(*args, **extra))
