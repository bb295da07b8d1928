"""The Triton kernels, run by Triton's interpreter on CPU tensors, against the reference.

conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported. Shapes are tiny (the
interpreter runs every program in Python) but cross slice, chunk, block and split boundaries;
every cache slot that no sequence owns is NaN.
"""

from __future__ import annotations

import importlib
import os
import random

import pytest
import torch
from paged_cases import TOLERANCES, assert_close, make_case, poison_before_window

import pagecli_kernels
from pagecli_kernels import reference
from tests.sizes import FULL

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1"
    and os.environ.get("PAGECLI_KERNEL_TEST_DEVICE") != "cuda",
    reason="needs Triton's interpreter or a CUDA device",
)
pytest.importorskip("triton")

DTYPES = list(TOLERANCES)


def _decode_args(case):
    return (case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)


def _prefill_args(case):
    return (
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.seq_lens,
        case.query_start_loc,
        case.scale,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_matches_reference(dtype, group):
    # lengths 1, block_size - 1, block_size + 1 and a few blocks, in shuffled blocks
    case = make_case(
        [1, 7, 9, 30],
        [1, 1, 1, 1],
        block_size=8,
        num_kv_heads=2 if group < 8 else 1,
        group=group,
        head_dim=64,
        dtype=dtype,
        seed=group,
    )
    expected = reference.paged_decode_attention(*_decode_args(case))
    assert_close(
        pagecli_kernels.paged_decode_attention(*_decode_args(case), impl="triton"), expected
    )


@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [80, 96, 128])
def test_decode_split_k_and_head_dims(num_splits, head_dim):
    # 100 tokens of context in 16-token blocks: splits of 32 tokens, some of them empty
    decode = importlib.import_module("pagecli_kernels.decode_attention")
    case = make_case(
        [100, 3, 33],
        [1, 1, 1],
        block_size=16,
        num_kv_heads=1,
        group=4,
        head_dim=head_dim,
        dtype=torch.float32,
        seed=num_splits,
    )
    expected = reference.paged_decode_attention(*_decode_args(case))
    actual = decode.paged_decode_attention(*_decode_args(case), num_splits=num_splits)
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_prefill_matches_reference(dtype, group):
    # a whole prompt, a chunk over a cached prefix, and a decode token, in one call
    case = make_case(
        [11, 21, 6],
        [11, 5, 1],
        block_size=8,
        num_kv_heads=1,
        group=group,
        head_dim=64,
        dtype=dtype,
        seed=group,
    )
    expected = reference.paged_prefill_attention(*_prefill_args(case))
    actual = pagecli_kernels.paged_prefill_attention(*_prefill_args(case), impl="triton")
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_many_query_slices(dtype):
    # 70 and 40 new tokens cross the query slice (32 for float32, 64 for 16-bit), head_dim 80
    case = make_case(
        [70, 50, 1],
        [70, 40, 1],
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_dim=80,
        dtype=dtype,
    )
    expected = reference.paged_prefill_attention(*_prefill_args(case))
    actual = pagecli_kernels.paged_prefill_attention(*_prefill_args(case), impl="triton")
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 3, 8, 64, None] if FULL else [1, 8, None])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_and_sinks_match_reference(dtype, window, with_sinks):
    # decodes and prefill chunks over prefixes longer than the window, in 8-token blocks (the
    # smallest the kernels take): window 8 is one block, 64 is longer than every sequence and
    # than the block table. Every position no new token sees is NaN, so reading outside the
    # window fails.
    decode = importlib.import_module("pagecli_kernels.decode_attention")
    rng = random.Random((window or 0) * 10 + with_sinks)
    seq_lens = [1, 4, 13, 23, 40, 17]
    query_lens = [1, 1, 13, 6, 1, 2]
    case = make_case(
        seq_lens, query_lens, block_size=8, num_kv_heads=2, group=3, head_dim=64, dtype=dtype
    )
    if window is not None:
        poison_before_window(case, window)
    sinks = None
    if with_sinks:  # large and small against the scores, so that a misplaced sink shows
        sinks = torch.tensor([rng.uniform(-3.0, 3.0) for _ in range(6)]).to(dtype)
        sinks = sinks.to(case.query.device)
    extra = {"window": window, "sinks": sinks}
    expected = reference.paged_prefill_attention(*_prefill_args(case), **extra)
    actual = pagecli_kernels.paged_prefill_attention(*_prefill_args(case), **extra, impl="triton")
    assert_close(actual, expected)

    rows = torch.tensor([i for i, n in enumerate(query_lens) if n == 1])
    tokens = case.query_start_loc.cpu()[rows].long()
    args = (case.query[tokens], case.k_cache, case.v_cache, case.block_tables[rows])
    args += (case.seq_lens[rows], case.scale)
    expected = reference.paged_decode_attention(*args, **extra)
    assert_close(pagecli_kernels.paged_decode_attention(*args, **extra, impl="triton"), expected)
    for num_splits in (1, 4):  # the sink in the kernel, then in the reduce
        actual = decode.paged_decode_attention(*args, **extra, num_splits=num_splits)
        assert_close(actual, expected)


@pytest.mark.parametrize("window", [5, 40, 70, None])
@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_split_k_with_window_and_sinks(window, num_splits):
    # the splits cover the window only: with window 40 and 8 splits, sequence 0's two 32-token
    # splits start at position 60, on no chunk or block boundary; the sink enters once
    decode = importlib.import_module("pagecli_kernels.decode_attention")
    case = make_case(
        [100, 3, 70, 33],
        [1, 1, 1, 1],
        block_size=16,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.float32,
        seed=num_splits,
    )
    if window is not None:
        poison_before_window(case, window)
    sinks = torch.linspace(-2.0, 2.0, 8, device=case.query.device)
    expected = reference.paged_decode_attention(*_decode_args(case), window=window, sinks=sinks)
    actual = decode.paged_decode_attention(
        *_decode_args(case), window=window, sinks=sinks, num_splits=num_splits
    )
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 33])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_prefill_many_query_slices_with_window_and_sinks(dtype, window, with_sinks):
    # query slices past the first start past the window's start: whole K/V chunks are skipped,
    # and in the first one walked most rows see nothing (window 5), some rows part of it
    case = make_case(
        [70, 90, 1],
        [70, 40, 1],
        block_size=16,
        num_kv_heads=1,
        group=2,
        head_dim=80,
        dtype=dtype,
    )
    poison_before_window(case, window)
    sinks = torch.tensor([1.5, -0.5], device=case.query.device) if with_sinks else None
    extra = {"window": window, "sinks": sinks}
    expected = reference.paged_prefill_attention(*_prefill_args(case), **extra)
    actual = pagecli_kernels.paged_prefill_attention(*_prefill_args(case), **extra, impl="triton")
    assert_close(actual, expected)


def test_bad_window_or_sinks_raise():
    case = make_case(
        [5], [1], block_size=8, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32
    )
    for window, sinks, match in ((0, None, "window"), (None, torch.zeros(3), "sinks must be")):
        with pytest.raises(ValueError, match=match):
            pagecli_kernels.paged_decode_attention(
                *_decode_args(case), window=window, sinks=sinks, impl="triton"
            )
        with pytest.raises(ValueError, match=match):
            pagecli_kernels.paged_prefill_attention(
                *_prefill_args(case), window=window, sinks=sinks, impl="triton"
            )


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference_and_skips_negative_slots(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 3, 8, 3, 64
    # a strided view, like one layer of a [num_blocks, 2, ...] allocation
    base = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"))
    k_cache, v_cache = base.to(dtype)[:, 0], base.to(dtype)[:, 1]
    key = torch.randn(5, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(5, num_kv_heads, head_dim).to(dtype)
    slot_mapping = torch.tensor([17, -1, 0, 23, 8], dtype=torch.int64)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slot_mapping)
    pagecli_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping, impl="triton")
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, atol=0, rtol=0)
    assert int(torch.isnan(k_cache).any(dim=(2, 3)).sum()) == num_blocks * block_size - 4


def test_public_store_kv_stays_the_op_after_triton_import():
    # importing pagecli_kernels.store_kv (the module) must not shadow the public op
    importlib.import_module("pagecli_kernels.store_kv")
    case = make_case(
        [3], [1], block_size=8, num_kv_heads=1, group=1, head_dim=64, dtype=torch.float32
    )
    key = torch.zeros(1, 1, 64)
    pagecli_kernels.store_kv(
        key, key, case.k_cache, case.v_cache, torch.tensor([-1]), impl="triton"
    )
    assert callable(pagecli_kernels.store_kv)
    assert pagecli_kernels.store_kv.__module__ == "pagecli_kernels.ops"


@pytest.mark.parametrize("head_dim", [32, 72, 256])
def test_unsupported_head_dim_raises(head_dim):
    case = make_case(
        [5], [1], block_size=8, num_kv_heads=1, group=2, head_dim=head_dim, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="head_dim"):
        pagecli_kernels.paged_decode_attention(*_decode_args(case), impl="triton")
    with pytest.raises(ValueError, match="head_dim"):
        pagecli_kernels.paged_prefill_attention(*_prefill_args(case), impl="triton")


@pytest.mark.parametrize("block_size", [4, 12, 256])
def test_unsupported_block_size_raises(block_size):
    case = make_case(
        [5], [1], block_size=block_size, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="block_size"):
        pagecli_kernels.paged_decode_attention(*_decode_args(case), impl="triton")


def test_unsupported_dtype_raises():
    case = make_case(
        [5], [1], block_size=8, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32
    )
    args = list(_decode_args(case))
    args[0], args[1], args[2] = args[0].double(), args[1].double(), args[2].double()
    with pytest.raises(ValueError, match="dtype"):
        pagecli_kernels.paged_decode_attention(*args, impl="triton")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    case = make_case(
        [5], [1], block_size=8, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32
    )
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        pagecli_kernels.paged_decode_attention(*_decode_args(case), impl="triton")


def test_bad_impl_raises():
    case = make_case(
        [5], [1], block_size=8, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32
    )
    with pytest.raises(ValueError, match="impl"):
        pagecli_kernels.paged_decode_attention(*_decode_args(case), impl="Triton")


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_group_larger_than_one_program(num_splits):
    # 20 query heads per KV head take two 16-row programs per KV head
    decode = importlib.import_module("pagecli_kernels.decode_attention")
    case = make_case(
        [5, 40], [1, 1], block_size=8, num_kv_heads=2, group=20, head_dim=64, dtype=torch.float32
    )
    expected = reference.paged_decode_attention(*_decode_args(case))
    assert_close(
        decode.paged_decode_attention(*_decode_args(case), num_splits=num_splits), expected
    )
