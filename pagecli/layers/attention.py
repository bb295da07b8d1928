"""Attention over the paged KV cache: store the new K/V, then attend through block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import pagecli_kernels as kernels
from pagecli_kernels.ops import Impl


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch: the first `num_decode_tokens` tokens are
    decodes (one per sequence), the rest are prefill chunks laid back to back. Slots and
    block tables come per KV cache group (engine/kv_groups.py; G = 1 for a uniform model):
    a layer reads its group's."""

    slot_mapping: torch.Tensor  # [G, T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [G, D, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [D] int32
    prefill_block_tables: torch.Tensor | None  # [G, P, max_blocks] int32
    prefill_seq_lens: torch.Tensor | None  # [P] int32
    prefill_query_start_loc: torch.Tensor | None  # [P + 1] int32
    # LongRoPE models only: the tokens that rotate with the long-context table ([T] bool;
    # layers/rotary.py); None elsewhere
    long_rope_rows: torch.Tensor | None = None
    # models with recurrent layers only: each sequence's state slot, decodes then prefills
    # ([S] int64; layers/gated_delta.py), and the first token of each ([S + 1] int32, from
    # 0: the decodes' one token each, then the prefill chunks); None elsewhere
    state_slots: torch.Tensor | None = None
    state_starts: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Writes this layer's new K/V into its cache and attends over each sequence's cache (the
    last `window` positions of it for a sliding-window layer; with per-head `sinks`, set by
    the layer that owns them, as one more softmax term)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.sinks: torch.Tensor | None = None  # [num_heads] float32, or None
        self.k_cache: torch.Tensor | None = None  # [num_blocks, block_size, Hk, D]
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0  # whose slots and block tables it reads (set by the model runner)
        self.impl: Impl = "auto"  # set by the model runner (attention_impl)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hk, D]
        impl = self.impl
        extra = {"window": self.window, "sinks": self.sinks, "impl": impl}
        g = self.kv_group
        kernels.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping[g], impl=impl)
        num_decode = meta.num_decode_tokens
        decode_tables = None if num_decode == 0 else meta.decode_block_tables[g]
        prefill_tables = meta.prefill_block_tables
        if num_decode < q.shape[0]:
            prefill_tables = prefill_tables[g]
        if num_decode == q.shape[0]:
            return kernels.paged_decode_attention(
                q,
                self.k_cache,
                self.v_cache,
                decode_tables,
                meta.decode_seq_lens,
                self.scale,
                **extra,
            )
        if num_decode == 0:
            return kernels.paged_prefill_attention(
                q,
                self.k_cache,
                self.v_cache,
                prefill_tables,
                meta.prefill_seq_lens,
                meta.prefill_query_start_loc,
                self.scale,
                **extra,
            )
        out = torch.empty_like(q)
        out[:num_decode] = kernels.paged_decode_attention(
            q[:num_decode],
            self.k_cache,
            self.v_cache,
            decode_tables,
            meta.decode_seq_lens,
            self.scale,
            **extra,
        )
        out[num_decode:] = kernels.paged_prefill_attention(
            q[num_decode:],
            self.k_cache,
            self.v_cache,
            prefill_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_start_loc,
            self.scale,
            **extra,
        )
        return out
