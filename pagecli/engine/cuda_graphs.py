"""CUDA graphs for decode batches: the model's forward pass captured once per batch size.

Decode steps of small models are dominated by kernel-launch overhead; replaying a captured
graph launches the whole forward pass at once. Batch sizes are captured from a fixed list and a
batch is padded up to the next one (padding tokens write nowhere: slot -1). Only decode-only
batches use graphs; prefills and mixed batches run eagerly. `--enforce-eager` turns this off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagecli.layers.attention import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, min(max_num_seqs, 512) + 1, 16))
    if sizes[-1] < min(max_num_seqs, 512):
        sizes.append(min(max_num_seqs, 512))
    return sizes


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [G, B] int64, per KV cache group
    block_tables: torch.Tensor  # [G, B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    hidden: torch.Tensor  # [B, H]


class DecodeGraphs:
    """Captured decode forward passes, one per batch size, sharing one memory pool."""

    def __init__(
        self,
        model,
        max_num_seqs: int,
        max_blocks: int,
        num_kv_groups: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        biggest = self.sizes[-1]
        self.static = _StaticInputs(
            input_ids=torch.zeros(biggest, dtype=torch.long, device=device),
            positions=torch.zeros(biggest, dtype=torch.long, device=device),
            slot_mapping=torch.full((num_kv_groups, biggest), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(
                num_kv_groups, biggest, max_blocks, dtype=torch.int32, device=device
            ),
            seq_lens=torch.ones(biggest, dtype=torch.int32, device=device),
            hidden=torch.zeros(biggest, hidden_size, dtype=dtype, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture()

    def _meta(self, batch: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            slot_mapping=s.slot_mapping[:, :batch],
            num_decode_tokens=batch,
            decode_block_tables=s.block_tables[:, :batch],
            decode_seq_lens=s.seq_lens[:batch],
            prefill_block_tables=None,
            prefill_seq_lens=None,
            prefill_query_start_loc=None,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        s = self.static
        pool = None
        for batch in reversed(self.sizes):  # largest first, so smaller ones reuse its pool
            meta = self._meta(batch)
            # Warm up outside the graph (Triton compiles and autotunes here).
            s.hidden[:batch] = self.model(s.input_ids[:batch], s.positions[:batch], meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                s.hidden[:batch] = self.model(s.input_ids[:batch], s.positions[:batch], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of `num_seqs` decodes runs at, or None if too large."""
        return next((b for b in self.sizes if b >= num_seqs), None)

    def run(self, input_ids, positions, slot_mapping, block_tables, seq_lens) -> torch.Tensor:
        """Replay for a decode batch; the arguments are the real (unpadded) device tensors.
        Returns the hidden states [num_seqs, H] (a view into the static output)."""
        n = input_ids.shape[0]
        batch = self.padded_size(n)
        s = self.static
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:, :n].copy_(slot_mapping)
        s.slot_mapping[:, n:batch].fill_(-1)  # padding rows store nothing
        s.seq_lens[:n].copy_(seq_lens)
        s.seq_lens[n:batch].fill_(1)
        s.block_tables[:, :n, : block_tables.shape[2]].copy_(block_tables)
        self.graphs[batch].replay()
        return s.hidden[:n]
