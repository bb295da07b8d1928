"""Quantize float checkpoints at load time (`--quantization q8_0 | q4_k`) into GGUF blocks.

- Q8_0 (and Q4_1): gguf.quants.quantize (bit-exact with ggml's quantize_row_q8_0_ref).
- Q4_K: the gguf package only dequantizes K-quants. `quantize_q4_k` is a numpy port of
  ggml's quantize_row_q4_K_ref (make_qkx2_quants: weighted least squares over 21 candidate
  scales per 32-value sub-block, then 6-bit sub-block scales and mins); its float32 sums run
  in numpy's order, so a rare tie may round differently from ggml; the format is the same.
  The loader runs the native kernel (pagecli_kernels/csrc/quantize_cpu.c, vectorized, all
  threads), byte for byte the port (tests/kernels/test_quantize_cpu.py); the port is its
  reference and the fallback without the native library.
- A tensor is converted to float32 256 rows at a time, so a float16 7B embedding never has a
  whole float32 copy; the blocks go into one buffer allocated once.

Which tensors: the linear projections and the token embedding (2-D weights). Under q4_k a
weight whose rows are not whole 256-value super-blocks (SmolLM2's 576 features) takes Q4_1
instead, the nearest 32-block format (llama.cpp falls back to Q5_0 there), and the token
embedding, which is also the tied output projection, takes Q8_0, as llama.cpp's K-quant mixes
keep the output projection at a higher precision.
"""

from __future__ import annotations

import numpy as np
import torch

from pagecli_kernels.quant_formats import FORMATS, QuantWeight

QUANTIZED_SUFFIXES = (
    "_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
    *(f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")),  # Gated DeltaNet's
)
CHUNK_ROWS = 256  # rows converted to float32 and quantized at a time


def wants_quantization(name: str, ndim: int) -> bool:
    """Whether quantize-at-load applies to this checkpoint tensor (a 2-D projection or the
    token embedding)."""
    return ndim == 2 and name.endswith(QUANTIZED_SUFFIXES)


def weight_format(name: str, cols: int, mode: str) -> str:
    """The format `mode` ("q8_0" or "q4_k") gives tensor `name` of `cols` columns."""
    if mode == "q8_0" or name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "q8_0"
    if mode == "q4_k":
        return "q4_k" if cols % 256 == 0 else "q4_1"
    raise ValueError(f"unknown quantization {mode!r}")


def quantize_weight(name: str, tensor: torch.Tensor, mode: str) -> QuantWeight:
    """`tensor` [rows, cols] in the format `mode` ("q8_0" or "q4_k") picks for `name`."""
    rows, cols = tensor.shape
    fmt = weight_format(name, cols, mode)
    f = FORMATS[fmt]
    if cols % f.block_values:
        raise ValueError(f"{name}: {cols} columns are not whole {fmt} blocks")
    from pagecli_kernels import quant_cpu

    native = fmt == "q4_k" and quant_cpu.library() is not None
    out = torch.empty(rows, cols // f.block_values * f.block_bytes, dtype=torch.uint8)
    tensor = tensor.detach()
    for start in range(0, rows, CHUNK_ROWS):
        part = tensor[start : start + CHUNK_ROWS].float().contiguous()  # [<=256, cols]
        if native:
            quant_cpu.quantize_q4_k_rows(part, out[start : start + CHUNK_ROWS])
            continue
        if fmt == "q4_k":
            raw = quantize_q4_k(part.numpy())
        else:
            import gguf

            raw = gguf.quants.quantize(part.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
        out[start : start + CHUNK_ROWS] = torch.from_numpy(raw.reshape(part.shape[0], -1))
    return QuantWeight(f, out, cols)


def _nearest_int(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)  # ggml's nearest_int: round half to even


def _make_qkx2_quants(x: np.ndarray, weights: np.ndarray, nmax: int = 15):
    """ggml's make_qkx2_quants(n=32, nmax, rmin=-1, rdelta=0.1, nstep=20, use_mad=false)
    over many sub-blocks at once: x, weights [S, 32] float32 -> (scale [S], -min [S], L [S, 32])."""
    f32 = np.float32
    xmin = np.minimum(x.min(axis=1), 0).astype(f32)  # [S]
    xmax = x.max(axis=1)
    sum_w = weights.sum(axis=1, dtype=f32)
    sum_x = (weights * x).sum(axis=1, dtype=f32)
    flat = xmax == xmin
    span = np.where(flat, f32(1), xmax - xmin).astype(f32)
    iscale = (f32(nmax) / span).astype(f32)
    scale = (f32(1) / iscale).astype(f32)
    levels = np.clip(_nearest_int(iscale[:, None] * (x - xmin[:, None])), 0, nmax)
    diff = scale[:, None] * levels.astype(f32) + xmin[:, None] - x
    best_error = (weights * diff * diff).sum(axis=1, dtype=f32)
    best_min = xmin.copy()
    for step in range(21):
        iscale = ((f32(-1) + f32(0.1) * f32(step) + f32(nmax)) / span).astype(f32)
        laux = np.clip(_nearest_int(iscale[:, None] * (x - xmin[:, None])), 0, nmax)
        lf = laux.astype(f32)
        sum_l = (weights * lf).sum(axis=1, dtype=f32)
        sum_l2 = (weights * lf * lf).sum(axis=1, dtype=f32)
        sum_xl = (weights * lf * x).sum(axis=1, dtype=f32)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe_det = np.where(ok, det, f32(1))
        this_scale = ((sum_w * sum_xl - sum_x * sum_l) / safe_det).astype(f32)
        this_min = ((sum_l2 * sum_x - sum_l * sum_xl) / safe_det).astype(f32)
        positive = this_min > 0
        safe_l2 = np.where(sum_l2 > 0, sum_l2, f32(1))
        this_scale = np.where(positive, sum_xl / safe_l2, this_scale).astype(f32)
        this_min = np.where(positive, f32(0), this_min).astype(f32)
        diff = this_scale[:, None] * lf + this_min[:, None] - x
        cur_error = (weights * diff * diff).sum(axis=1, dtype=f32)
        better = ok & (cur_error < best_error) & ~flat
        levels = np.where(better[:, None], laux, levels)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale).astype(f32)
        best_min = np.where(better, this_min, best_min).astype(f32)
    scale = np.where(flat, f32(0), scale)
    levels = np.where(flat[:, None], 0, levels)
    return scale, -best_min, levels


def quantize_q4_k(data: np.ndarray, chunk_rows: int = 256) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) -> Q4_K blocks [rows, cols / 256 * 144]."""
    rows, cols = data.shape
    out = np.empty((rows, cols // 256 * 144), dtype=np.uint8)
    for start in range(0, rows, chunk_rows):
        part = data[start : start + chunk_rows]
        out[start : start + chunk_rows] = _quantize_q4_k_blocks(part.reshape(-1, 256)).reshape(
            part.shape[0], -1
        )
    return out


def _quantize_q4_k_blocks(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    num_blocks = x.shape[0]
    sub = x.reshape(num_blocks * 8, 32).astype(f32)  # [S, 32]
    av_x = np.sqrt((sub * sub).sum(axis=1, dtype=f32) / f32(32)).astype(f32)
    weights = (av_x[:, None] + np.abs(sub)).astype(f32)
    scales, mins, _ = _make_qkx2_quants(sub, weights)
    scales, mins = scales.reshape(num_blocks, 8), mins.reshape(num_blocks, 8)
    max_scale = np.maximum(scales.max(axis=1), 0).astype(f32)
    max_min = np.maximum(mins.max(axis=1), 0).astype(f32)
    inv_scale = np.where(max_scale > 0, f32(63) / np.where(max_scale > 0, max_scale, 1), 0)
    inv_min = np.where(max_min > 0, f32(63) / np.where(max_min > 0, max_min, 1), 0)
    ls = np.minimum(_nearest_int(inv_scale[:, None].astype(f32) * scales), 63).astype(np.uint8)
    lm = np.minimum(_nearest_int(inv_min[:, None].astype(f32) * mins), 63).astype(np.uint8)
    packed = np.zeros((num_blocks, 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d16 = (max_scale / f32(63)).astype(np.float16)
    dmin16 = (max_min / f32(63)).astype(np.float16)
    d = d16.astype(f32)[:, None] * ls.astype(f32)  # [B, 8], as the kernels rebuild it
    dm = dmin16.astype(f32)[:, None] * lm.astype(f32)
    xs = x.reshape(num_blocks, 8, 32)
    safe_d = np.where(d != 0, d, f32(1))[:, :, None]
    levels = np.clip(_nearest_int((xs + dm[:, :, None]) / safe_d), 0, 15)
    levels = np.where((d != 0)[:, :, None], levels, 0).astype(np.uint8)  # ggml leaves L as is
    pairs = levels.reshape(num_blocks, 4, 2, 32)
    qs = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(num_blocks, 128)
    return np.concatenate(
        [d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), packed, qs],
        axis=1,
    )
