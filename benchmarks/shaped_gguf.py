"""pagecli against llama.cpp on GGUF files of real model shapes, one table over shapes and mixes.

Writes GGUF files at the shapes of Llama-3.2-1B and Llama-3-8B (llama architecture),
Gemma-3-1B (gemma3: sandwich norms, per-head q/k norms, head_dim 256, 5 sliding layers of 512
to 1 global), Phi-4-mini (phi3: fused q/k/v and gate/up, partial rotary, LongRoPE factors),
Qwen3.5-2B (qwen35: Gated DeltaNet layers, gated attention) and Qwen3-30B-A3B (qwen3moe: 3-D
expert stacks; the decode floor and the prefill's FLOPs count the experts a token uses),
all with the default model's tokenizer and its 49,152-token vocabulary (the real Gemma and Phi
vocabularies are 262k and 200k: both engines pay the same larger output projection there), in
five quantization mixes (q4_0, q8_0, q4_k_m, q5_k_m, q6_k), with random but valid blocks:
random quant values, positive f16 scales sized so that the weights come out about 0.02 apart
(a trained model's spread), so the activations stay finite through every layer. Speed does
not depend on the values, so these
files measure what a real file of the same shape and mix would, without downloading one.
The files are written tensor by tensor (the writer never holds a whole file) and cached under
--dir; a file already there with the planned tensors and size is reused.

Then, --rounds times, for each file: this machine's read bandwidth (benchmarks/decode_floor.py's
probe) and float32 FMA peak (benchmarks/fma_peak.py), `llama-bench -p 512 -n 128 -r R` and
`pagecli bench --scenario latency --pp 512 --tg 128 --repetitions R`, the two engines back to
back, in turn first, so that a shared machine's drift moves both sides of a ratio. The table
gives the median round's figures, each ratio as the median of the rounds' own ratios (the
rounds in brackets). Beside the decode figures is the bandwidth floor: weight bytes one decode
token reads (every layer tensor, the output projection and one embedding row) / the read
bandwidth measured in that round. Beside the prefill figures is their ceiling: the prefill's
FLOPs (prefill_flops) / that round's FMA peak, which no product with float32 activations
passes on a CPU without matrix tiles (llama.cpp rounds activations to 8 bits and is not bound
by it). A second table gives decode's rate per thread (weight bytes per token x tokens/s /
threads) and the threads each engine would need at that rate to read 60 GB/s (a 16-core
desktop) and 300 GB/s (a 64-core server); at --threads 1 it is the per-core rate. The
llama.cpp binaries are the static builds in ../shared/peers/llama.cpp/bin. Quiet machines only.

    .venv/bin/python benchmarks/shaped_gguf.py [--shapes 1b,8b] [--mixes q4_0,q8_0,...]
        [--threads 2] [--rounds 3] [--repetitions 1] [--dir /tmp/pagecli-shaped]
        [--layers N] [--write-only] [--json OUT.json]
    # a quick end-to-end check: tiny files (or real widths with --layers 1), short tests
    .venv/bin/python benchmarks/shaped_gguf.py --shapes smoke --rounds 1 --pp 16 --tg 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from decode_floor import read_bandwidth
from fma_peak import fma_peak
from quant_vs_llamacpp import PAGECLI, PEERS, cpu_name, run

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    tied: bool  # no output.weight: the token embedding is the output projection
    arch: str = "llama"  # the GGUF architecture: llama, gemma3 or phi3
    head_dim: int | None = None  # None: hidden / heads
    window: int | None = None  # gemma3's sliding window
    rotary_dim: int | None = None  # phi3's and qwen35's partial rotary width
    original_context: int | None = None  # phi3's LongRoPE original context
    # qwen35's Gated DeltaNet layers (three of every `interval`): key heads, value heads,
    # their width, the conv kernel
    linear: tuple[int, int, int, int] | None = None
    interval: int = 4
    # qwen3moe's and gpt-oss's experts in every layer: how many, how many a token uses,
    # each one's width
    experts: tuple[int, int, int] | None = None

    def is_linear(self, layer: int) -> bool:
        return self.linear is not None and (layer + 1) % self.interval != 0

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads


VOCAB = 49152  # the default model's tokenizer
# context_length is 8192 for both: llama-bench sizes its context to the test (p + n) and pagecli
# to its KV budget, so a longer one only changes pagecli's max_model_len, not a figure here.
# Llama 3.2's llama3 rope scaling (rope_freqs.weight) is left out: a few multiplies per token.
SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 8192, 500000.0, tied=True),  # Llama-3.2-1B
    # Gemma-3-1B: hidden 1152 is no multiple of 256, so the K-quant mixes fall back to Q5_0 and
    # Q8_0 for every tensor of 1152 columns, as llama.cpp's quantizer does
    "gemma3-1b": Shape(
        1152, 26, 4, 1, 6912, 1000000.0, tied=True, arch="gemma3", head_dim=256, window=512
    ),
    # Phi-4-mini's dimensions in the llama architecture (Llama-3.2-3B-like): what the phi3
    # family's own graph costs, side by side
    "phi4-mini-dims": Shape(3072, 32, 24, 8, 8192, 10000.0, tied=True),
    "phi4-mini": Shape(
        3072,
        32,
        24,
        8,
        8192,
        10000.0,
        tied=True,
        arch="phi3",
        rotary_dim=96,
        original_context=4096,
    ),  # fmt: skip
    # Qwen3.5-2B (qwen35): 24 layers, 18 of them Gated DeltaNet (16 key and 16 value heads
    # of 128, conv kernel 4), 6 gated full attention (8 heads of 256, 2 KV heads, a quarter
    # rotary); tied; the real vocabulary is 248k
    "qwen35-2b": Shape(
        2048,
        24,
        8,
        2,
        6144,
        10000000.0,
        tied=True,
        arch="qwen35",
        head_dim=256,
        rotary_dim=64,
        linear=(16, 16, 128, 4),
    ),  # fmt: skip
    "qwen35-smoke": Shape(
        256,
        4,
        2,
        1,
        512,
        10000000.0,
        tied=True,
        arch="qwen35",
        head_dim=64,
        rotary_dim=16,
        linear=(2, 4, 32, 4),
    ),  # fmt: skip
    # Qwen3-30B-A3B (qwen3moe): 48 layers, 32 heads of 128 over 4 KV heads, per-head q/k
    # norms, 128 experts of 768 in every layer, 8 per token; the real vocabulary is 152k
    "qwen3-30b-a3b": Shape(
        2048,
        48,
        32,
        4,
        6144,
        1000000.0,
        tied=False,
        arch="qwen3moe",
        head_dim=128,
        experts=(128, 8, 768),
    ),  # fmt: skip
    "qwen3moe-smoke": Shape(
        256,
        2,
        4,
        2,
        512,
        1000000.0,
        tied=False,
        arch="qwen3moe",
        head_dim=64,
        experts=(8, 2, 128),
    ),  # fmt: skip
    # gpt-oss-20b (gpt-oss): 24 layers, 64 heads of 64 over 8 KV heads with biases and
    # sinks, a window of 128 on every other layer, YaRN (32 over 4096), 32 experts of 2880
    # in every layer, 4 per token, with biases; the real vocabulary is 201k
    "gpt-oss-20b": Shape(
        2880,
        24,
        64,
        8,
        2880,
        150000.0,
        tied=False,
        arch="gpt-oss",
        head_dim=64,
        window=128,
        experts=(32, 4, 2880),
    ),  # fmt: skip
    "gpt-oss-smoke": Shape(
        256,
        2,
        4,
        2,
        256,
        150000.0,
        tied=False,
        arch="gpt-oss",
        head_dim=64,
        window=128,
        experts=(8, 2, 256),
    ),  # fmt: skip
    "8b": Shape(4096, 32, 32, 8, 14336, 500000.0, tied=False),  # Llama-3-8B
    "7b": Shape(4096, 32, 32, 32, 11008, 10000.0, tied=False),  # Llama-2-7B (MHA)
    "smoke": Shape(256, 2, 4, 2, 512, 500000.0, tied=True),  # for testing this script
}
MIXES = {  # name: (the base block type, gguf file type)
    "q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_k_m": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k_m": (Q.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_M),
    "q6_k": (Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
    # gpt-oss's released GGUFs: the experts in MXFP4 as trained, the other matrices Q8_0
    "mxfp4": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
}
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Block:
    """Where a block format keeps its f16 scales, and the spread of its integer part."""

    d_offset: int
    dmin_offset: int | None  # K-quant minimum scale, or None
    int_std: float  # std of the integer factor multiplying d (quant value times sub-scale)
    q_mean: float  # mean quant value: dmin = d * q_mean centres the blocks on zero


# ggml's block layouts (ggml-common.h): Q4_0 {d, qs[16]}; Q8_0 {d, qs[32]}; Q5_0 {d, qh[4],
# qs[16]}; Q5_1 {d, m, qh[4], qs[16]}; Q4_K {d, dmin, scales[12], qs[128]}; Q5_K {d, dmin,
# scales[12], qh[32], qs[128]}; Q6_K {ql[128], qh[64], scales[16], d}. int_std for uniform
# random bytes: Q4_0 q-8 in -8..7; Q8_0 int8; Q5_0 q-16 in -16..15; Q5_1 q in 0..31 plus a
# negative m; Q4_K/Q5_K sc*q - (q_mean)*m with 6-bit sc, m and q in 0..15 / 0..31; Q6_K int8
# sc times q-32 in -32..31.
BLOCKS = {
    Q.Q4_0: Block(0, None, 4.64, 0.0),
    Q.Q5_0: Block(0, None, 9.23, 0.0),
    Q.Q5_1: Block(0, 2, 9.23, -15.5),
    Q.Q8_0: Block(0, None, 73.9, 0.0),
    Q.Q4_K: Block(0, 2, 245.0, 7.5),
    Q.Q5_K: Block(0, 2, 527.0, 15.5),
    Q.Q6_K: Block(208, None, 1366.0, 0.0),
}


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


# llama.cpp's fallback where a row is not whole 256-value blocks (llama-quant.cpp)
K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def tensor_type(name: str, layer: int | None, shape: Shape, mix: str, cols: int) -> Q:
    """The block type of a 2-D tensor of `cols` columns in `mix`: `mix_type`'s choice, with
    llama.cpp's fallback for rows that are not whole 256-value blocks (Gemma-3-1B's 1152): a
    tied embedding or an output projection to Q8_0, the rest Q4_K -> Q5_0, Q5_K -> Q5_1,
    Q6_K -> Q8_0."""
    chosen = mix_type(name, layer, shape, mix)
    block = gguf.constants.GGML_QUANT_SIZES[chosen][0]
    if cols % block == 0:
        return chosen
    if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
        return Q.Q8_0
    return K_FALLBACK[chosen]


def mix_type(name: str, layer: int | None, shape: Shape, mix: str) -> Q:
    """The block type of a 2-D tensor in `mix`.

    q4_0, q8_0 and q6_k are pure: every 2-D tensor in that type (llama-quantize's Q4_0 would
    put output.weight, or a tied token_embd, in Q6_K; the pure file measures one kernel). The
    _M mixes follow llama.cpp's llama_tensor_get_type_impl (src/llama-quant.cpp, read at
    ggml-org/llama.cpp 007dbbf; the peer build is 0c1e570) for a llama model without experts:
    - output.weight, and token_embd.weight when there is no output.weight (tied), take Q6_K
      (`new_type != GGML_TYPE_Q8_0` -> Q6_K); an untied token_embd keeps the base type;
    - attn_v (and a fused attn_qkv: llama.cpp counts it as attn_v) takes Q6_K when
      use_more_bits(i_attention_wv, n_attention_wv), ffn_down (and an MoE's ffn_down_exps:
      llama.cpp matches the name's start) when use_more_bits(i_layer, n_layer): the first
      and last eighths of the layers and every third layer in between;
    - an MoE's router (ffn_gate_inp) stays F32;
    - everything else the base type (llama_ftype_get_default_type: Q4_K_M -> Q4_K,
      Q5_K_M -> Q5_K).
    """
    base = MIXES[mix][0]
    if name.endswith("ffn_gate_inp.weight") and mix in ("q4_k_m", "q5_k_m", "mxfp4"):
        return Q.F32  # llama-quantize leaves the router in float
    if mix == "mxfp4":
        return Q.MXFP4 if "_exps." in name else base
    if mix not in ("q4_k_m", "q5_k_m"):
        return base
    if name == "output.weight" or (name == "token_embd.weight" and shape.tied):
        return Q.Q6_K
    part = name.split(".")[-2]
    if layer is not None and (part in ("attn_v", "attn_qkv") or part.startswith("ffn_down")):
        return Q.Q6_K if use_more_bits(layer, shape.layers) else base
    return base


@dataclass(frozen=True)
class Tensor:
    name: str
    rows: int  # 0 for a 1-D tensor (a norm: F32)
    cols: int
    type: Q
    experts: int = 0  # a 3-D expert stack of this many [rows, cols] matrices

    @property
    def nbytes(self) -> int:
        block_values, block_bytes = gguf.constants.GGML_QUANT_SIZES[self.type]
        stacked = max(self.experts, 1)
        return stacked * max(self.rows, 1) * self.cols // block_values * block_bytes

    @property
    def gguf_shape(self) -> tuple[int, ...]:
        """numpy order (rows first), as GGUFReader reports it reversed."""
        if self.experts:
            return (self.experts, self.rows, self.cols)
        return (self.cols,) if self.rows == 0 else (self.rows, self.cols)


# qwen35 tensors stored in F32 whatever the mix (llama.cpp quantizes none of them)
F32_PARTS = ("ssm_conv1d", "ssm_a", "ssm_dt.bias")


def layer_parts(shape: Shape, layer: int = 0) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of one layer's tensors in the arch's order; rows 0: a norm (a
    name with a suffix is the whole tensor name)."""
    h, d = shape.hidden, shape.head_size
    q, kv = shape.heads * d, shape.kv_heads * d
    if shape.arch == "gpt-oss":  # GptOssModel: biases everywhere, sinks, expert biases
        count, _, width = shape.experts
        return [
            ("attn_norm", 0, h), ("attn_q", q, h), ("attn_q.bias", 0, q), ("attn_k", kv, h),
            ("attn_k.bias", 0, kv), ("attn_v", kv, h), ("attn_v.bias", 0, kv),
            ("attn_output", h, q), ("attn_output.bias", 0, h),
            ("attn_sinks.weight", 0, shape.heads), ("post_attention_norm", 0, h),
            ("ffn_gate_inp", count, h),
            ("ffn_gate_inp.bias", 0, count), ("ffn_gate_exps", width, h),
            ("ffn_gate_exps.bias", count, width), ("ffn_up_exps", width, h),
            ("ffn_up_exps.bias", count, width), ("ffn_down_exps", h, width),
            ("ffn_down_exps.bias", count, h),
        ]  # fmt: skip
    if shape.arch == "qwen3moe":
        count, _, width = shape.experts
        return [
            ("attn_norm", 0, h), ("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h),
            ("attn_q_norm", 0, d), ("attn_k_norm", 0, d), ("attn_output", h, q),
            ("ffn_norm", 0, h), ("ffn_gate_inp", count, h), ("ffn_gate_exps", width, h),
            ("ffn_up_exps", width, h), ("ffn_down_exps", h, width),
        ]  # fmt: skip
    if shape.arch == "qwen35":
        ffn = [
            ("post_attention_norm", 0, h), ("ffn_gate", shape.ffn, h), ("ffn_up", shape.ffn, h),
            ("ffn_down", h, shape.ffn),
        ]  # fmt: skip
        if not shape.is_linear(layer):  # q_proj: each head's query and its output gate
            return [
                ("attn_norm", 0, h), ("attn_q", 2 * q, h), ("attn_k", kv, h),
                ("attn_v", kv, h), ("attn_q_norm", 0, d), ("attn_k_norm", 0, d),
                ("attn_output", h, q), *ffn,
            ]  # fmt: skip
        k_heads, v_heads, width, kernel = shape.linear
        conv, value = (2 * k_heads + v_heads) * width, v_heads * width
        return [
            ("attn_norm", 0, h), ("attn_qkv", conv, h), ("attn_gate", value, h),
            ("ssm_beta", v_heads, h), ("ssm_alpha", v_heads, h), ("ssm_conv1d", conv, kernel),
            ("ssm_dt.bias", 0, v_heads), ("ssm_a", 0, v_heads), ("ssm_norm", 0, width),
            ("ssm_out", h, value), *ffn,
        ]  # fmt: skip
    if shape.arch == "gemma3":
        return [
            ("attn_norm", 0, h), ("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h),
            ("attn_q_norm", 0, d), ("attn_k_norm", 0, d), ("attn_output", h, q),
            ("post_attention_norm", 0, h), ("ffn_norm", 0, h), ("ffn_gate", shape.ffn, h),
            ("ffn_up", shape.ffn, h), ("ffn_down", h, shape.ffn), ("post_ffw_norm", 0, h),
        ]  # fmt: skip
    if shape.arch == "phi3":  # llama.cpp keeps Phi-3's fused q/k/v and [gate; up]
        return [
            ("attn_norm", 0, h), ("attn_qkv", q + 2 * kv, h), ("attn_output", h, q),
            ("ffn_norm", 0, h), ("ffn_up", 2 * shape.ffn, h), ("ffn_down", h, shape.ffn),
        ]  # fmt: skip
    return [
        ("attn_norm", 0, h), ("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h),
        ("attn_output", h, q), ("ffn_norm", 0, h), ("ffn_gate", shape.ffn, h),
        ("ffn_up", shape.ffn, h), ("ffn_down", h, shape.ffn),
    ]  # fmt: skip


def tensor_plan(shape: Shape, mix: str) -> list[Tensor]:
    """Every tensor of the file, in the order written."""
    h = shape.hidden
    embd_type = tensor_type("token_embd.weight", None, shape, mix, h)
    plan = [Tensor("token_embd.weight", VOCAB, h, embd_type)]
    if shape.rotary_dim is not None and shape.original_context is not None:
        for which in ("long", "short"):  # LongRoPE's factors, one per rotary pair
            plan.append(Tensor(f"rope_factors_{which}.weight", 0, shape.rotary_dim // 2, Q.F32))
    for i in range(shape.layers):
        for part, rows, cols in layer_parts(shape, i):
            name = f"blk.{i}.{part}" + ("" if part == "ssm_a" or "." in part else ".weight")
            experts = shape.experts[0] if part.endswith("_exps") else 0
            if rows == 0 or part in F32_PARTS or part.endswith(".bias"):
                plan.append(Tensor(name, rows, cols, Q.F32))
            else:
                kind = tensor_type(name, i, shape, mix, cols)
                plan.append(Tensor(name, rows, cols, kind, experts))
    plan.append(Tensor("output_norm.weight", 0, h, Q.F32))
    if not shape.tied:
        out_type = tensor_type("output.weight", None, shape, mix, h)
        plan.append(Tensor("output.weight", VOCAB, h, out_type))
    return plan


def random_blocks(t: Tensor, rng: np.random.Generator) -> np.ndarray:
    """`t`'s data as [rows, row bytes] uint8: random quant values and sub-scales, positive
    f16 scales giving weights of about WEIGHT_STD."""
    if t.type == Q.F32:
        if t.name.endswith(".bias") and "ssm_dt" not in t.name:  # gpt-oss's biases
            return rng.normal(0, 0.02, size=(t.rows, t.cols) if t.rows else t.cols)
        if t.name.endswith("attn_sinks.weight"):
            return rng.normal(0, 1.0, size=t.cols)
        if t.name.endswith("ssm_a"):  # A = -exp(A_log) < 0: the state decays
            return -rng.uniform(0.5, 1.5, size=t.cols).astype(np.float32)
        if t.name.endswith("ssm_dt.bias"):
            return np.zeros(t.cols, dtype=np.float32)
        if t.rows:  # a 2-D F32 tensor: qwen35's conv kernel
            return rng.normal(0, 0.2, size=(t.rows, t.cols))
        return np.ones(t.cols, dtype=np.float32)  # norm weights, rope factors
    block_values, block_bytes = gguf.constants.GGML_QUANT_SIZES[t.type]
    rows = t.rows * max(t.experts, 1)
    n_blocks = rows * t.cols // block_values
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    if t.type == Q.MXFP4:  # {e8m0 scale, qs[16]}: FP4 values (up to 6) times 2^(e - 127)
        blocks[:, 0] = rng.integers(119, 122, size=n_blocks, dtype=np.uint8)
        return blocks.reshape(t.experts, t.rows, -1) if t.experts else blocks.reshape(rows, -1)
    spec = BLOCKS[t.type]
    if t.type == Q.Q8_0:  # ggml's quantizer writes -127..127, never -128
        qs = blocks[:, 2:].view(np.int8)
        np.maximum(qs, -127, out=qs)
    d = (WEIGHT_STD / spec.int_std) * rng.uniform(0.5, 1.5, size=n_blocks)
    blocks[:, spec.d_offset : spec.d_offset + 2] = (
        d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    )
    if spec.dmin_offset is not None:  # Q5_1's m is added: negative to centre its blocks
        dmin = (d * spec.q_mean).astype(np.float16)
        blocks[:, spec.dmin_offset : spec.dmin_offset + 2] = dmin.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1) if not t.experts else blocks.reshape(t.experts, t.rows, -1)


def tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType, object]]:
    """The default model's tokenizer.* fields (vocabulary, merges, ids, chat template) as
    (name, value, type, array element type), read with pagecli's GGUF reader (gguf's own
    takes about 6 s over the 49k-token vocabulary and its merges)."""
    from pagecli.loader.gguf_file import GGUFFile
    from pagecli.loader.resolve import default_gguf_path

    kinds = {
        np.dtype(np.int32): gguf.GGUFValueType.INT32,
        np.dtype(np.uint32): gguf.GGUFValueType.UINT32,
        np.dtype(np.float32): gguf.GGUFValueType.FLOAT32,
    }
    fields = []
    with GGUFFile(default_gguf_path()) as source:
        for name in source.keys():
            if not name.startswith("tokenizer."):
                continue
            value = source.get(name)
            if isinstance(value, bool):
                fields.append((name, value, gguf.GGUFValueType.BOOL, None))
            elif isinstance(value, int):
                fields.append((name, value, gguf.GGUFValueType.UINT32, None))
            elif isinstance(value, str):
                fields.append((name, value, gguf.GGUFValueType.STRING, None))
            elif isinstance(value, list):  # of str
                fields.append((name, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING))
            else:  # a numeric array
                array = np.asarray(value)
                fields.append((name, array.tolist(), gguf.GGUFValueType.ARRAY, kinds[array.dtype]))
        vocab = len(source.get("tokenizer.ggml.tokens"))
    if vocab != VOCAB:
        raise SystemExit(f"the default model's vocabulary has {vocab} tokens, expected {VOCAB}")
    return fields


def matches_plan(path: Path, plan: list[Tensor]) -> bool:
    """Whether `path` holds exactly the planned tensors, whole (its size reaches the last)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception:  # truncated or not GGUF
        return False
    found = [
        (t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)))
        for t in reader.tensors
    ]
    wanted = [(t.name, int(t.type), t.gguf_shape) for t in plan]
    end = max(int(t.data_offset) + int(t.n_bytes) for t in reader.tensors)
    return found == wanted and path.stat().st_size >= end


def write_gguf(path: Path, shape: Shape, mix: str, seed: int = 0) -> None:
    """Write the file tensor by tensor (to a temporary name, renamed when complete)."""
    plan = tensor_plan(shape, mix)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), shape.arch)
    writer.add_name(f"pagecli {path.stem} (random weights)")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.rotary_dim or shape.head_size)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch in ("gemma3", "qwen35") else 1e-5)
    writer.add_vocab_size(VOCAB)
    if shape.head_dim is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.window is not None:
        writer.add_sliding_window(shape.window)
    if shape.arch == "gpt-oss":  # GptOssModel.set_gguf_parameters: YaRN as released
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    if shape.original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(shape.original_context)
        writer.add_rope_scaling_attn_factors(1.19)
    writer.add_file_type(int(MIXES[mix][1]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, value, kind, sub_type in tokenizer_fields():
        writer.add_key_value(name, value, kind, sub_type=sub_type)
    if shape.experts is not None:  # Qwen3MoeModel's and GptOssModel's set_gguf_parameters
        count, used, width = shape.experts
        writer.add_expert_count(count)
        writer.add_expert_used_count(used)
        writer.add_expert_feed_forward_length(width)
    if shape.linear is not None:  # Qwen3NextModel.set_gguf_parameters
        k_heads, v_heads, width, kernel = shape.linear
        writer.add_ssm_conv_kernel(kernel)
        writer.add_ssm_state_size(width)
        writer.add_ssm_group_count(k_heads)
        writer.add_ssm_time_step_rank(v_heads)
        writer.add_ssm_inner_size(v_heads * width)
        writer.add_full_attention_interval(shape.interval)
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    for t in plan:
        if t.type == Q.F32:
            writer.add_tensor_info(t.name, t.gguf_shape, np.dtype(np.float32), t.nbytes)
        else:  # a byte shape: the writer turns it into values
            row_bytes = t.nbytes // t.rows // max(t.experts, 1)
            byte_shape = (t.experts, t.rows, row_bytes) if t.experts else (t.rows, row_bytes)
            writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, t.type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    for t in plan:
        data = random_blocks(t, rng)
        writer.write_tensor_data(data.astype(np.float32) if t.type == Q.F32 else data)
    writer.close()
    os.replace(partial, path)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # ru_maxrss is in KiB
    print(f"pagecli: shaped_gguf: wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
          f"{time.perf_counter() - start:.0f} s; peak RSS so far {peak_gb:.2f} GB",
          file=sys.stderr)  # fmt: skip


def ensure_file(folder: Path, shape_name: str, mix: str, layers: int | None) -> Path:
    """The file of `shape_name` (with `layers` layers when given) in `mix`, written if needed."""
    shape = SHAPES[shape_name]
    if layers is not None:
        shape, shape_name = dataclasses.replace(shape, layers=layers), f"{shape_name}-{layers}L"
    path = folder / f"{shape_name}-{mix}.gguf"
    if path.exists() and matches_plan(path, tensor_plan(shape, mix)):
        return path
    folder.mkdir(parents=True, exist_ok=True)
    write_gguf(path, shape, mix)
    return path


def read_tensors(path: Path):
    """A GGUF file's tensor table, through pagecli's reader (gguf's GGUFReader parses the
    49k-token vocabulary into numpy views one by one: about 6 s a file). Its entries have
    GGUFReader's names, shapes (ggml order), element and byte counts."""
    from pagecli.loader.gguf_file import GGUFFile

    with GGUFFile(path) as reader:
        return reader


def output_projection(reader):
    """output.weight, or the token embedding where the file ties them."""
    by_name = {t.name: t for t in reader.tensors}
    return by_name.get("output.weight", by_name["token_embd.weight"])


def layer_matrices(reader) -> list:
    """The layers' projections: 2-D tensors and 3-D expert stacks (norms are 1-D)."""
    return [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) >= 2]


def state_bytes(path: Path) -> int:
    """Bytes of one sequence's recurrent states (float32 [value heads, width, width] in each
    Gated DeltaNet layer; 0 for other archs): a decode step reads them and writes them back."""
    reader = read_tensors(path)
    arch = reader.get("general.architecture")
    rank = reader.get(f"{arch}.ssm.time_step_rank")
    if rank is None:
        return 0
    width = int(reader.get(f"{arch}.ssm.state_size"))
    layers = sum(1 for t in reader.tensors if t.name.endswith(".ssm_out.weight"))
    return layers * int(rank) * width * width * 4


def active_share(reader, t) -> float:
    """The share of a layer tensor one token reads: expert_used_count / expert_count of a
    3-D expert stack (only the chosen experts' rows), all of anything else."""
    if len(t.shape) != 3:
        return 1.0
    arch = reader.get("general.architecture")
    return int(reader.get(f"{arch}.expert_used_count")) / int(reader.get(f"{arch}.expert_count"))


def bytes_per_token(path: Path) -> int:
    """Bytes one decode token moves: every layer tensor (of an expert stack, the chosen
    experts' share: the active bytes), the output projection (the whole token embedding when
    tied), one row of the embedding, and the recurrent states read and written back
    (state_bytes, twice)."""
    reader = read_tensors(path)
    total = sum(
        int(t.n_bytes) * active_share(reader, t)
        for t in reader.tensors
        if t.name.startswith("blk.")
    )
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    total += int(output_projection(reader).n_bytes) + int(embed.n_bytes) // VOCAB
    return int(total + 2 * state_bytes(path))


def decode_macs(path: Path) -> int:
    """Multiply-adds of one token through the layer matrices and the output projection."""
    reader = read_tensors(path)
    return int(
        sum(int(t.n_elements) * active_share(reader, t) for t in layer_matrices(reader))
        + int(output_projection(reader).n_elements)
    )


def prefill_flops(path: Path, pp: int) -> float:
    """FLOPs of a `pp`-token prefill: every layer matrix once per token, causal attention
    (scores and values: q width x (pp + 1) / 2 positions on average, twice) and the output
    projection for the last token only, as both engines run it. Two FLOPs per multiply-add."""
    reader = read_tensors(path)
    matrices = layer_matrices(reader)
    outputs = [t for t in matrices if t.name.endswith(".attn_output.weight")]
    macs = pp * sum(int(t.n_elements) * active_share(reader, t) for t in matrices)
    macs += sum(int(t.shape[0]) for t in outputs) * pp * (pp + 1)  # q width, each layer
    macs += int(output_projection(reader).n_elements)
    arch = reader.get("general.architecture")
    rank = reader.get(f"{arch}.ssm.time_step_rank")
    if rank is not None:  # the chunked delta rule per token and value head (gated_delta.py)
        width = int(reader.get(f"{arch}.ssm.state_size"))
        layers = sum(1 for t in matrices if t.name.endswith(".ssm_out.weight"))
        per_head = 3 * width * width + 64 * 5 * width  # state passes; 64-token chunks
        macs += pp * layers * int(rank) * per_head
    return 2.0 * macs


def llama_bench(path: Path, threads: int, pp: int, tg: int, repetitions: int) -> dict:
    out = run(
        [str(PEERS / "bin" / "llama-bench"), "-m", str(path), "-t", str(threads),
         "-p", str(pp), "-n", str(tg), "-r", str(repetitions), "-o", "json"]
    )  # fmt: skip
    found = {}
    for row in json.loads(out):
        found["pp" if row["n_prompt"] else "tg"] = float(row["avg_ts"])
    return found


def pagecli_bench(path: Path, threads: int, pp: int, tg: int, repetitions: int) -> dict:
    out = run(
        [str(PAGECLI), "bench", "--model", str(path), "--num-threads", str(threads),
         "--scenario", "latency", "--pp", str(pp), "--tg", str(tg),
         "--repetitions", str(repetitions), "--json"]
    )  # fmt: skip
    report = json.loads(out)
    rates = {row["test"]: row["tokens_per_s_mean"] for row in report["results"]}
    return {
        "pp": rates[f"pp{pp}"],
        "tg": rates[f"tg{tg}"],
        "weight_formats": report.get("weight_formats"),
    }


def measure(engine: str, bench_fn, *args) -> dict | None:
    """`bench_fn(*args)`: one engine's figures, or None (the error on stderr) when it fails."""
    try:
        return bench_fn(*args)
    except (subprocess.CalledProcessError, KeyError, ValueError) as exc:
        print(f"pagecli: shaped_gguf: {engine} failed: {exc}", file=sys.stderr)
        return None


def one_round(args, files: list[Path], weight_bytes: dict, flops: dict, number: int) -> dict:
    """Each file once: the bandwidth and FMA probes, then the two engines (pagecli first in even
    rounds)."""
    found = {}
    for path in files:
        bandwidth = read_bandwidth(args.threads)
        peak = fma_peak(args.threads)
        bench = (args.threads, args.pp, args.tg, args.repetitions)
        engines = [("pagecli", pagecli_bench), ("llama.cpp", llama_bench)]
        row = {"read_bandwidth_gb_s": bandwidth / 1e9,
               "floor_ms": 1000 * weight_bytes[path.name] / bandwidth,
               "fma_peak_gflop_s": peak / 1e9,
               "pp_ceiling_t_s": args.pp * peak / flops[path.name]}  # fmt: skip
        for engine, fn in engines if number % 2 == 0 else engines[::-1]:
            row[engine] = measure(engine, fn, path, *bench)
        ours, theirs = row["pagecli"], row["llama.cpp"]
        for engine, got in (("pagecli", ours), ("llama.cpp", theirs)):
            if got is not None:
                row[f"{engine}_ms_over_floor"] = 1000 / got["tg"] / row["floor_ms"]
                row[f"{engine}_pp_of_ceiling"] = got["pp"] / row["pp_ceiling_t_s"]
        if ours is not None and theirs is not None:
            row["pp_ratio"] = ours["pp"] / theirs["pp"]
            row["tg_ratio"] = ours["tg"] / theirs["tg"]
        print(f"pagecli: shaped_gguf: round {number}: {path.name}: {json.dumps(row)}",
              file=sys.stderr)  # fmt: skip
        found[path.name] = row
    return found


def cpu_line(threads: int) -> str:
    return f"{cpu_name()}; {threads} threads"


def report(args, files: list[Path], rounds: list[dict]) -> None:
    def median(name: str, get) -> str:
        values = [v for r in rounds if (v := get(r[name])) is not None]
        return f"{statistics.median(values):.1f}" if values else "-"

    def ratio(name: str, key: str) -> str:
        values = [r[name][key] for r in rounds if key in r[name]]
        if not values:
            return "-"
        each = ", ".join(f"{v:.2f}" for v in values)
        return f"{statistics.median(values):.2f}x ({each})"

    def rate(engine: str, key: str):
        return lambda row: row[engine][key] if row[engine] is not None else None

    pp, tg = f"pp{args.pp}", f"tg{args.tg}"
    print(
        f"CPU: {cpu_line(args.threads)}; medians of {args.rounds} rounds (a ratio: the median "
        "of the rounds' own ratios); floor = weight bytes per token / read bandwidth; "
        f"{pp} ceiling = the prefill's FLOPs / the float32 FMA peak (benchmarks/fma_peak.py), "
        "the most a float32 product can do; 'of ceiling' = the engine's rate over it"
    )
    print(f"| file | size GB | {pp} pagecli t/s | {pp} llama.cpp t/s | {pp} ratio | "
          f"{pp} ceiling t/s | pagecli of ceiling | llama.cpp of ceiling | "
          f"{tg} pagecli t/s | {tg} llama.cpp t/s | {tg} ratio | floor ms | pagecli ms/floor | "
          f"llama.cpp ms/floor |")  # fmt: skip
    print("| --- " * 14 + "|")
    for path in files:
        name = path.name
        floor = statistics.median(r[name]["floor_ms"] for r in rounds)
        ceiling = statistics.median(r[name]["pp_ceiling_t_s"] for r in rounds)
        print(
            f"| {name} | {path.stat().st_size / 1e9:.2f} | {median(name, rate('pagecli', 'pp'))} | "
            f"{median(name, rate('llama.cpp', 'pp'))} | {ratio(name, 'pp_ratio')} | "
            f"{ceiling:.1f} | {ratio(name, 'pagecli_pp_of_ceiling')} | "
            f"{ratio(name, 'llama.cpp_pp_of_ceiling')} | "
            f"{median(name, rate('pagecli', 'tg'))} | {median(name, rate('llama.cpp', 'tg'))} | "
            f"{ratio(name, 'tg_ratio')} | {floor:.2f} | {ratio(name, 'pagecli_ms_over_floor')} | "
            f"{ratio(name, 'llama.cpp_ms_over_floor')} |"
        )


ENGINES = ("pagecli", "llama.cpp")


def per_thread_report(args, files: list[Path], rounds: list[dict], weight_bytes: dict) -> None:
    """Decode's bytes per second per thread, and the threads that rate needs to reach a desktop's
    and a server's bandwidth (at --threads 1: per core)."""
    tg = f"tg{args.tg}"
    print(
        f"\nDecode per thread ({tg}): weight bytes per token x tokens/s / {args.threads} "
        "threads, GB/s, and the threads each engine needs, at that rate, to read as fast as a "
        "16-core desktop's 60 GB/s and a 64-core server's 300 GB/s (the rate is compute-bound "
        "where it is below the read rate per thread; measured at --threads 1 it is per core)"
    )
    print(
        "| file | read GB/s per thread | pagecli GB/s per thread | llama.cpp GB/s per thread | "
        "threads for 60 GB/s, pagecli / llama.cpp | threads for 300 GB/s, pagecli / llama.cpp |"
    )
    print("| --- " * 6 + "|")
    for path in files:
        name = path.name
        probe = statistics.median(r[name]["read_bandwidth_gb_s"] for r in rounds) / args.threads
        per = {}
        for engine in ENGINES:
            rates = [r[name][engine]["tg"] for r in rounds if r[name][engine] is not None]
            if rates:
                per[engine] = statistics.median(rates) * weight_bytes[name] / args.threads / 1e9
        shown = [f"{per[e]:.2f}" if e in per else "-" for e in ENGINES]
        need = [
            " / ".join(str(math.ceil(target / per[e])) if e in per else "-" for e in ENGINES)
            for target in (60, 300)
        ]
        print(f"| {name} | {probe:.1f} | {shown[0]} | {shown[1]} | {need[0]} | {need[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,8b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--mixes", default=",".join(MIXES), help="comma-separated")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagecli-shaped"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repetitions", type=int, default=1, help="of each test per round")
    parser.add_argument("--pp", type=int, default=512, help="prompt tokens of the pp test")
    parser.add_argument("--tg", type=int, default=128, help="generated tokens of the tg test")
    parser.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the shape's (quick checks)"
    )
    parser.add_argument("--write-only", action="store_true", help="write the files, run nothing")
    parser.add_argument("--json", type=Path, default=None, help="save the raw results here")
    args = parser.parse_args()
    shapes, mixes = args.shapes.split(","), args.mixes.split(",")
    unknown = [s for s in shapes if s not in SHAPES] + [m for m in mixes if m not in MIXES]
    if unknown or args.pp < 1 or args.tg < 1 or (args.layers is not None and args.layers < 1):
        parser.error(
            f"unknown shapes or mixes: {unknown}" if unknown else "--pp, --tg, --layers: >= 1"
        )
    files = [ensure_file(args.dir, s, m, args.layers) for s in shapes for m in mixes]
    if args.write_only:
        return
    weight_bytes = {path.name: bytes_per_token(path) for path in files}
    flops = {path.name: prefill_flops(path, args.pp) for path in files}
    rounds = [one_round(args, files, weight_bytes, flops, number) for number in range(args.rounds)]
    if args.json is not None:
        result = {
            "cpu": cpu_line(args.threads),
            "threads": args.threads,
            "pp": args.pp,
            "tg": args.tg,
            "repetitions": args.repetitions,
            "files": {p.name: {"path": str(p), "bytes": p.stat().st_size,
                               "weight_bytes_per_token": weight_bytes[p.name],
                               "prefill_flops": flops[p.name]} for p in files},
            "rounds": rounds,
        }  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2))
    report(args, files, rounds)
    per_thread_report(args, files, rounds, weight_bytes)


if __name__ == "__main__":
    main()
