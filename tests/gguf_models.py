"""Tiny random-weight Llama checkpoints written as GGUF files, one per supported block format.

The gguf package's writer lays them out as llama.cpp's converter does (Q/K rows permuted for
its rope layout, norms in F32). Weights are drawn in float32 and quantized: Q8_0, Q4_0, Q4_1,
Q5_0 and Q5_1 with gguf.quants.quantize, Q4_K with pagecli's port of ggml's quantizer, Q5_K
and Q6_K with the plain min/max quantizers below (any valid blocks do: both transformers and
pagecli read the same file). "q4_k_m" is laid out as llama.cpp's Q4_K_M with a tied
embedding: Q4_K with Q6_K v and down projections and a Q6_K embedding, so the fused q/k/v
layer mixes two block formats. "mixed" is the same with an untied Q6_K output and its up
projection left F32, so gate/up mixes blocks and floats. No tokenizer: tests pass token ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 384
QK_STD = 0.3  # sharp attention, so that positions (and a wrong Q/K row order) matter
FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's permute of Q/K rows."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """A plain Q6_K encoding: per 16 values scale = max|x| / 32, int8 sub-scales of d."""
    blocks = x.reshape(-1, 16, 16)  # [B, sub-blocks, 16]
    sub = np.abs(blocks).max(axis=2) / 32  # [B, 16]
    d = (sub.max(axis=1) / 127).astype(np.float16).astype(np.float32)  # [B]
    sc = np.clip(np.rint(sub / np.where(d > 0, d, 1)[:, None]), 1, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)  # [B, 16]
    q = np.clip(np.rint(blocks / np.where(step > 0, step, 1)[:, :, None]), -32, 31).astype(int)
    q = (q + 32).reshape(-1, 2, 128)  # [B, half, 128]: value e of half h
    ql = np.zeros((q.shape[0], 2, 64), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 2, 32), dtype=np.uint8)
    for s in range(4):  # 32-value group s of each half
        vals = q[:, :, 32 * s : 32 * s + 32]
        ql[:, :, 32 * (s & 1) : 32 * (s & 1) + 32] |= ((vals & 0xF) << (4 * (s >> 1))).astype(
            np.uint8
        )
        qh |= ((vals >> 4) << (2 * s)).astype(np.uint8)
    n = q.shape[0]
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16(d)], axis=1
    )


def _quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """A plain Q5_K encoding: per 32 values min/max, 6-bit sub-scales and mins of d, dmin."""
    blocks = x.reshape(-1, 8, 32)  # [B, sub-blocks, 32]
    lo = np.minimum(blocks.min(axis=2), 0)
    scale = (blocks.max(axis=2) - lo) / 31  # [B, 8]
    d = (scale.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(axis=1) / 63).astype(np.float16).astype(np.float32)
    ls = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 1, 63).astype(np.uint8)
    lm = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * ls.astype(np.float32)
    offset = dmin[:, None] * lm.astype(np.float32)
    q = np.clip(np.rint((blocks + offset[:, :, None]) / step[:, :, None]), 0, 31).astype(int)
    n = blocks.shape[0]
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    qh = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):
        qh |= ((q[:, i] >> 4) << i).astype(np.uint8)
    low = (q & 0xF).reshape(n, 4, 2, 32)
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).astype(np.uint8).reshape(n, 128)
    return np.concatenate([_f16(d), _f16(dmin), scales, qh, qs], axis=1)


def quantize(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 [rows, cols] -> raw blocks [rows, row_bytes] in `fmt`."""
    import gguf

    from pagecli.loader.quantize import quantize_q4_k

    rows = x.shape[0]
    if fmt == "q4_k":
        return quantize_q4_k(x)
    if fmt == "q5_k":
        return _quantize_q5_k(x).reshape(rows, -1)
    if fmt == "q6_k":
        return _quantize_q6_k(x).reshape(rows, -1)
    if fmt == "iq4_nl":
        return _quantize_iq4_nl(x).reshape(rows, -1)
    if fmt == "iq4_xs":
        return _quantize_iq4_xs(x).reshape(rows, -1)
    return gguf.quants.quantize(x, gguf.GGMLQuantizationType[fmt.upper()])


IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32
)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> IQ4_NL blocks (gguf has no quantizer for it): per 32 values
    an f16 scale putting the largest magnitude on the table's -127, each value the nearest
    table entry's index; nibbles packed as Q4_0's (value j low, j + 16 high)."""
    blocks = x.reshape(-1, 32)
    peak = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
    d = (peak / -127.0).astype(np.float16)
    scale = d.astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale)[:, None, None]
    q = np.abs(blocks[:, :, None] / safe - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    out = np.empty((len(blocks), 18), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = packed
    return out


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] -> IQ4_XS super-blocks (gguf has no quantizer for it): per 256
    values an f16 d, per 32 a 6-bit scale ls with d * (ls - 32) near the scale that puts the
    sub-block's largest magnitude on the table's -127, each value the nearest entry of the
    table under it."""
    sub = x.reshape(-1, 8, 32)  # [super-blocks, sub-blocks, values]
    flat = sub.reshape(-1, 32)
    peak = flat[np.arange(len(flat)), np.abs(flat).argmax(1)].reshape(-1, 8)
    want = peak / -127.0  # each sub-block's scale
    d = (np.abs(want).max(1) / 31.0).astype(np.float16)  # [super-blocks]
    d32 = d.astype(np.float32)[:, None]
    level = np.clip(np.rint(want / np.where(d32 == 0, 1.0, d32)), -32, 31).astype(np.int32)
    dl = d32 * level.astype(np.float32)  # [super-blocks, 8]
    safe = np.where(dl == 0, 1.0, dl)[:, :, None, None]
    q = np.abs(sub[..., None] / safe - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # [super-blocks, 8, 16]
    ls = (level + 32).astype(np.uint32)  # 0..63
    scales_l = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)  # [super-blocks, 4]
    scales_h = ((ls >> 4) << (2 * np.arange(8))).sum(1).astype("<u2")
    out = np.empty((len(sub), 136), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = scales_h.view(np.uint8).reshape(-1, 2)
    out[:, 4:8] = scales_l.astype(np.uint8)
    out[:, 8:] = packed.reshape(len(sub), 128)
    return out


def _formats(kind: str) -> dict[str, str]:
    """Tensor role -> format (or "f32") for a file kind."""
    if kind == "mixed":
        return {"embd": "q4_k", "q": "q4_k", "k": "q4_k", "v": "q6_k", "o": "q4_k",
                "gate": "q4_k", "up": "f32", "down": "q6_k", "output": "q6_k"}  # fmt: skip
    if kind == "q4_k_m":
        return {"embd": "q6_k", "q": "q4_k", "k": "q4_k", "v": "q6_k", "o": "q4_k",
                "gate": "q4_k", "up": "q4_k", "down": "q6_k"}  # fmt: skip
    return {role: kind for role in ("embd", "q", "k", "v", "o", "gate", "up", "down")}


def write_tiny_gguf(path: Path, kind: str, seed: int) -> Path:
    """A 2-layer Llama with random weights as a GGUF file; `kind` a format or "mixed"."""
    import gguf

    rng = np.random.default_rng(seed)
    formats = _formats(kind)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(1)

    def add(name: str, role: str, values: np.ndarray) -> None:
        fmt = formats.get(role, "f32")
        if fmt == "f32":
            writer.add_tensor(name, values.astype(np.float32))
            return
        qtype = gguf.GGMLQuantizationType[fmt.upper()]
        writer.add_tensor(name, quantize(values.astype(np.float32), fmt), raw_dtype=qtype)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", "embd", normal(VOCAB, HIDDEN, std=1.0))
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", "norm", 1 + normal(HIDDEN, std=0.1))
        add(f"blk.{i}.ffn_norm.weight", "norm", 1 + normal(HIDDEN, std=0.1))
        add(f"blk.{i}.attn_q.weight", "q", _permute(normal(HIDDEN, HIDDEN, std=QK_STD), HEADS))
        k = normal(KV_HEADS * head_dim, HIDDEN, std=QK_STD)
        add(f"blk.{i}.attn_k.weight", "k", _permute(k, KV_HEADS))
        add(f"blk.{i}.attn_v.weight", "v", normal(KV_HEADS * head_dim, HIDDEN, std=0.08))
        add(f"blk.{i}.attn_output.weight", "o", normal(HIDDEN, HIDDEN, std=0.08))
        add(f"blk.{i}.ffn_gate.weight", "gate", normal(INTERMEDIATE, HIDDEN, std=0.08))
        add(f"blk.{i}.ffn_up.weight", "up", normal(INTERMEDIATE, HIDDEN, std=0.08))
        add(f"blk.{i}.ffn_down.weight", "down", normal(HIDDEN, INTERMEDIATE, std=0.08))
    add("output_norm.weight", "norm", 1 + normal(HIDDEN, std=0.1))
    if "output" in formats:
        add("output.weight", "output", normal(VOCAB, HIDDEN, std=0.08))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_tiny_ggufs(root: Path) -> dict[str, Path]:
    """One file per supported format, and the two mixed ones."""
    return {
        kind: write_tiny_gguf(root / f"tiny-{kind}.gguf", kind, seed=2000 + i)
        for i, kind in enumerate([*FORMATS, "mixed", "q4_k_m"])
    }
