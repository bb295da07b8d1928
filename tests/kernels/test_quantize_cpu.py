"""The native Q4_K quantizer (csrc/quantize_cpu.c) against quantize.py's numpy port of
ggml's quantize_row_q4_K_ref: the same bytes, block for block, on rows that exercise every
branch (flat sub-blocks, all-zero rows, tiny and huge magnitudes, all-negative and
all-positive blocks), at several row counts and thread counts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagecli.loader.quantize import quantize_q4_k, quantize_weight
from pagecli_kernels import quant_cpu

pytestmark = pytest.mark.skipif(
    quant_cpu.library() is None, reason="no native kernels (no C compiler)"
)


def hard_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    kinds = [
        lambda r: np.zeros_like(r),
        lambda r: np.full_like(r, 0.37),  # every sub-block flat
        lambda r: r * 1e-6,
        lambda r: r * 3e4,
        lambda r: -np.abs(r),  # no positive value: min below zero, max below zero
        lambda r: np.abs(r) + 1,  # min above zero (the fit's min > 0 branch)
        lambda r: np.round(r * 2) / 2,  # many ties
    ]
    for i in range(rows):
        if i % 3 == 1:
            x[i] = kinds[(i // 3) % len(kinds)](x[i])
    return x


@pytest.mark.parametrize("rows", [1, 3, 7, 64])
@pytest.mark.parametrize("cols", [256, 768])
def test_native_q4_k_is_the_ports_bytes(rows, cols):
    x = hard_rows(rows, cols, seed=rows * 1000 + cols)
    ours = quant_cpu.quantize_q4_k_rows(torch.from_numpy(x)).numpy()
    theirs = quantize_q4_k(x)
    assert ours.shape == theirs.shape == (rows, cols // 256 * 144)
    differing = (ours.reshape(-1, 144) != theirs.reshape(-1, 144)).any(axis=1)
    assert not differing.any(), f"{differing.sum()} of {differing.size} blocks differ"


def test_threads_do_not_change_the_bytes():
    x = torch.from_numpy(hard_rows(33, 512, seed=5))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_cpu.quantize_q4_k_rows(x)
        torch.set_num_threads(max(2, previous))
        many = quant_cpu.quantize_q4_k_rows(x)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, many)


def test_the_blocks_dequantize_close_to_the_input():
    x = np.random.default_rng(2).standard_normal((16, 1024)).astype(np.float32)
    blocks = quant_cpu.quantize_q4_k_rows(torch.from_numpy(x)).numpy()
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    assert np.sqrt(np.mean((back - x) ** 2)) < 0.08  # ggml's Q4_K: about 7% on Gaussians


def test_float16_weights_quantize_in_row_chunks_as_float32_would():
    x = torch.randn(600, 256, generator=torch.Generator().manual_seed(3)).half()  # > 256 rows
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(
        quantize_weight(name, x, "q4_k").data, quantize_weight(name, x.float(), "q4_k").data
    )
    ours = quantize_weight(name, x, "q8_0").data.numpy()
    theirs = gguf.quants.quantize(x.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours, theirs)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="whole 256-blocks"):
        quant_cpu.quantize_q4_k_rows(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="whole 256-blocks"):
        quant_cpu.quantize_q4_k_rows(torch.zeros(2, 256, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        quant_cpu.quantize_q4_k_rows(torch.zeros(2, 256), torch.empty(2, 100, dtype=torch.uint8))
