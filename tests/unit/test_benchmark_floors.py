"""The floors that benchmarks/shaped_gguf.py prints beside its figures.

- prefill_flops and decode_macs count a prefill's and a decode token's work from the file's own
  tensors: they must equal the count by hand from the shape the file was written at (a
  reversed gguf shape, a norm counted as a matrix, or the output projection run for every
  prompt token would each change it).
- benchmarks/fma_peak.c takes the widest FMA vectors the CPU has.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagecli.engine.dtype_choice import cpu_flags
from tests.sizes import FULL

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import fma_peak
        import shaped_gguf
    finally:
        sys.path.pop(0)
    return shaped_gguf, fma_peak


@pytest.mark.parametrize("mix", ["q8_0", "q4_k_m"] if FULL else ["q4_k_m"])
def test_prefill_flops_count_the_shape(bench_modules, tmp_path, mix):
    shaped_gguf, _ = bench_modules
    shape = shaped_gguf.SHAPES["smoke"]
    path = shaped_gguf.ensure_file(tmp_path, "smoke", mix, None)
    pp = 48
    kv_width = shape.hidden // shape.heads * shape.kv_heads
    per_token = (
        shape.hidden * shape.hidden * 2  # q, o
        + shape.hidden * kv_width * 2  # k, v
        + shape.hidden * shape.ffn * 3  # gate, up, down
    )
    attention = shape.hidden * pp * (pp + 1)  # scores and values over the causal positions
    head = shaped_gguf.VOCAB * shape.hidden  # the last token only
    want = 2 * (shape.layers * (pp * per_token + attention) + head)
    assert shaped_gguf.prefill_flops(path, pp) == want
    assert shaped_gguf.decode_macs(path) == shape.layers * per_token + head


def test_fma_peak_takes_the_widest_vectors(bench_modules):
    _, fma_peak = bench_modules
    flags = cpu_flags()
    want = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 1
    assert fma_peak._library().pagecli_fma_lanes() == want
    assert fma_peak.fma_peak(1, passes=1, iters=100_000) > 0
