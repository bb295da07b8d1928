"""Where the time goes in one Gated DeltaNet layer, against a full-attention layer of the same
model at a long context: one decode (batch 1) and one prefill chunk.

The layers are Qwen3.5-0.8B-shaped by default (hidden 1024; DeltaNet: 16 key and 16 value
heads of 128; attention: 8 query heads over 2 KV heads of 256, output gate, (1 + w) q/k
norms), float32, random weights, torch's linears (both layers alike), the paged attention of
the CPU's native kernels over --context cached tokens. The DeltaNet's parts are timed twice:
the torch path's (conv, recurrence: recurrent_step or chunked_rule, gated norm) and the
native step that replaces them on the CPU (csrc/gated_delta_cpu.c, `native_step`); `whole`
is the layer's forward as the engine runs it (the native step). Prints the median of --reps
calls of each part, with the CPU named.

    .venv/bin/python benchmarks/deltanet_layer.py [--context 4096] [--chunk 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs
from quant_vs_llamacpp import cpu_name

from pagecli.layers.attention import AttentionMetadata
from pagecli.layers.gated_delta import (
    DeltaNetSpec,
    GatedDeltaNet,
    StateStore,
    chunked_rule,
    recurrent_step,
)
from pagecli.models.blocks import Attention, AttentionSpec
from pagecli_kernels import fused_cpu


def deltanet_parts(layer: GatedDeltaNet, hidden: torch.Tensor, meta, reps: int) -> dict:
    """The forward's parts, each timed alone on the same inputs (decode: one token)."""
    s = layer.spec
    n = hidden.shape[0]
    mixed, z, b, a = layer.in_proj(hidden).split(
        [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], dim=-1
    )
    conv = layer._conv(mixed, meta)
    q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
    q = q.reshape(n, s.num_k_heads, s.k_head_dim)
    k = k.reshape(n, s.num_k_heads, s.k_head_dim)
    v = v.reshape(n, s.num_v_heads, s.v_head_dim)
    g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    beta = b.sigmoid()
    state = layer.slots.ssm[0]
    if n == 1:
        rule = lambda: recurrent_step(q, k, v, g, beta, state[None])  # noqa: E731
    else:
        rule = lambda: chunked_rule(  # noqa: E731
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(), state
        )
    out = v
    projected = layer.in_proj(hidden)
    shape = (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim)

    def native():
        fused_cpu.gated_delta(
            projected, layer.native_weights(), s.eps, layer.slots.conv, layer.slots.ssm,
            meta.state_slots, meta.state_starts, shape, s.v_heads_tiled,
        )  # fmt: skip

    return {
        "in_proj": median_ms(lambda: layer.in_proj(hidden), reps),
        "conv": median_ms(lambda: layer._conv(mixed, meta), reps),
        "recurrence": median_ms(rule, reps),
        "gated_norm": median_ms(lambda: layer.norm(out, z.reshape(v.shape)), reps),
        "native_step": median_ms(native, reps),
        "out_proj": median_ms(lambda: layer.out_proj(out.reshape(n, -1)), reps),
        "whole": median_ms(lambda: layer(hidden, meta), reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = DeltaNetSpec(16, 16, 128, 128, 4, 1e-6)
    layer = GatedDeltaNet(spec, args.hidden)
    for p in layer.parameters():
        p.data.normal_(0, 0.02)
    layer.slots = StateStore.zeros(spec, 1, torch.float32, "cpu")
    attn_spec = AttentionSpec(8, 2, 256, 256**-0.5, qk_norm="head", output_gate=True, rope=None)
    attention = Attention(attn_spec, args.hidden, 1e-6, "offset")
    for p in attention.parameters():
        p.data.normal_(0, 0.02)
    bs = 16
    blocks = -(-(args.context + args.chunk) // bs)
    cache = torch.randn(2, blocks, bs, 2, 256)
    attention.attn.k_cache, attention.attn.v_cache = cache[0], cache[1]
    table = torch.arange(blocks, dtype=torch.int32)[None, None]  # [G, 1, blocks]
    results = {}
    for label, n in (("decode", 1), (f"prefill {args.chunk}", args.chunk)):
        hidden = torch.randn(n, args.hidden) * 0.1
        start = args.context
        if n == 1:
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([[start]]),
                num_decode_tokens=1,
                decode_block_tables=table,
                decode_seq_lens=torch.tensor([start + 1], dtype=torch.int32),
                prefill_block_tables=None,
                prefill_seq_lens=None,
                prefill_query_start_loc=None,
                state_slots=torch.tensor([0]),
                state_starts=torch.tensor([0, 1], dtype=torch.int32),
            )
        else:
            meta = AttentionMetadata(
                slot_mapping=torch.arange(start, start + n)[None],
                num_decode_tokens=0,
                decode_block_tables=None,
                decode_seq_lens=None,
                prefill_block_tables=table,
                prefill_seq_lens=torch.tensor([start + n], dtype=torch.int32),
                prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                state_slots=torch.tensor([0]),
                state_starts=torch.tensor([0, n], dtype=torch.int32),
            )
        with torch.inference_mode():
            parts = deltanet_parts(layer, hidden, meta, args.reps)
            call = lambda h=hidden, m=meta: attention(None, h, m)  # noqa: E731
            parts["attention_layer"] = median_ms(call, args.reps)
        results[label] = parts
    head = f"{cpu_name()}, {args.threads} threads, hidden {args.hidden}, context {args.context}"
    print(head)
    for label, parts in results.items():
        row = ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
        print(f"  {label} (ms): {row}")
    print(json.dumps({"cpu": cpu_name(), "args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
