"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

The model's layers declare how each weight is cut (`tp_splits()`, models/base.Split): q/k/v
and gate/up by output rows (column-parallel), o_proj and down_proj by input columns
(row-parallel: each rank's partial sums are added by one all-reduce), the embedding and the
output projection by vocabulary rows (vocab-parallel); norms are whole on every rank. A fused
checkpoint tensor (Phi-3's qkv_proj) keeps the rank's rows of each of its segments.

A mixture of experts is split the same way inside every expert (vLLM's tensor parallelism
without expert parallelism): each rank holds every expert's share of its columns (gate/up
by rows, down by columns) and the router whole, and one all-reduce sums the MoE's output.
The experts' width is its own axis where the config gives one (`moe_intermediate_size`,
and `shared_expert_intermediate_size` for a shared expert); Mixtral, OLMoE and gpt-oss
give theirs as `intermediate_size`, the MLP's axis.

Attention is split by whole KV-head groups, so that each rank's query heads share its own
KV heads the way the whole model's do (`q head i -> kv head i // group`). With more ranks
than KV heads, each KV head is replicated over `size / num_kv_heads` ranks that split its
group's query heads. Ranks may hold unequal shares where the counts do not divide (the
default model's 3 KV-head groups over 2 ranks: 1 and 2, the smaller share on rank 0, which
also schedules and samples); the MLP's columns and a row-parallel
tensor's columns are cut on the boundaries of its quantized blocks (32 or 256 values), so a
GGUF's blocks are never split. A size that cannot be honoured is a `SplitError` naming the
sizes that can.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pagecli.errors import SplitError

Range = tuple[int, int]  # [start, stop)
# rows: the rank's row ranges, in order; cols: one column range
Cut = tuple[Literal["rows"], tuple[Range, ...]] | tuple[Literal["cols"], Range]

MAX_SIZE_LISTED = 64  # the valid sizes a SplitError lists go up to this


@dataclass(frozen=True)
class RankShard:
    """One rank's share of the model: global index ranges of its heads, MLP columns and
    vocabulary rows."""

    rank: int
    size: int
    head_dim: int
    q_heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range
    vocab_rows: int  # the largest share of any rank (gathered logits are padded to it)
    # the whole model's counts of each axis: q_heads, kv_heads, intermediate, vocab and the
    # experts' axes where the config has them
    totals: tuple[tuple[str, int], ...] = ()
    expert_intermediate: Range = (0, 0)  # moe_intermediate_size's columns
    shared_intermediate: Range = (0, 0)  # shared_expert_intermediate_size's

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def local_config(self, hf_config):
        """The model config of this rank's layers: its heads and MLP width (the hidden size,
        head_dim and vocabulary stay the model's)."""
        local = copy.deepcopy(hf_config)
        local.num_attention_heads = self.num_heads
        local.num_key_value_heads = self.num_kv_heads
        local.head_dim = self.head_dim
        local.intermediate_size = self.intermediate[1] - self.intermediate[0]
        if getattr(local, "moe_intermediate_size", None):
            local.moe_intermediate_size = self.expert_intermediate[1] - self.expert_intermediate[0]
        if getattr(local, "shared_expert_intermediate_size", None):
            start, stop = self.shared_intermediate
            local.shared_expert_intermediate_size = stop - start
        return local

    def axis(self, name: str) -> tuple[Range, int]:
        """This rank's range of an axis ("q_heads", "kv_heads", "intermediate", "vocab") and
        the whole model's count of it."""
        ranges = {
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "expert_intermediate": self.expert_intermediate,
            "shared_intermediate": self.shared_intermediate,
        }
        if name not in ranges or name not in dict(self.totals):
            raise SplitError(f"unknown tensor-parallel axis {name!r}")
        return ranges[name], dict(self.totals)[name]

    def cut(self, split, parts: range | None, bias: bool) -> Cut | None | Literal["zero"]:
        """How to take a checkpoint tensor its layer cuts as `split` (models/base.Split),
        covering `parts` of its segments (None: all, or a one-segment split): the rank's rows
        of each covered segment, its columns, "zero" (a row-parallel bias, added once: by
        rank 0), or None (whole)."""
        if split.kind == "whole":
            return None
        if split.kind == "none":
            raise SplitError(
                f"--tensor-parallel-size {self.size} cannot split this model: {split.reason}"
            )
        if split.kind == "vocab":
            return ("rows", (self.vocab,))
        if split.kind == "row":
            if bias:
                return None if self.rank == 0 else "zero"
            ((axis, unit),) = split.segments
            (start, stop), _ = self.axis(axis)
            return ("cols", (start * unit, stop * unit))
        segments = split.segments if parts is None else split.segments[parts.start : parts.stop]
        ranges, offset = [], 0
        for axis, unit in segments:
            (start, stop), total = self.axis(axis)
            ranges.append((offset + start * unit, offset + stop * unit))
            offset += total * unit
        return ("rows", tuple(ranges))


def plan_shards(
    hf_config, size: int, row_blocks: Mapping[str, int] | None = None
) -> list[RankShard]:
    """Every rank's shard of a model split over `size` ranks. `row_blocks` maps each axis
    that row-parallel weights are cut along ("intermediate": down_proj, "q_heads": o_proj) to
    the widest block (values) of the block-format tensors cut along it: columns that must not
    be cut. SplitError, naming the sizes that work, when `size` cannot be honoured."""
    row_blocks = row_blocks or {}
    problem = _split_problem(hf_config, size, row_blocks)
    if problem is None:
        return [_shard(hf_config, size, rank, row_blocks) for rank in range(size)]
    works = [
        n for n in range(1, MAX_SIZE_LISTED + 1) if _split_problem(hf_config, n, row_blocks) is None
    ]
    raise SplitError(
        f"--tensor-parallel-size {size} cannot split this model: {problem} "
        f"(sizes that work: {', '.join(map(str, works)) or 'none'})"
    )


def _counts(hf_config) -> tuple[int, int, int, int, int]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    inter = getattr(hf_config, "intermediate_size", None) or 0
    return heads, kv_heads, head_dim, inter, hf_config.vocab_size


def _widths(hf_config) -> dict[str, int]:
    """The MLP widths the config gives: the dense MLP's (intermediate_size, where the model
    has one), each expert's (moe_intermediate_size) and the shared expert's."""
    widths = {}
    for axis, key in (
        ("intermediate", "intermediate_size"),
        ("expert_intermediate", "moe_intermediate_size"),
        ("shared_intermediate", "shared_expert_intermediate_size"),
    ):
        value = getattr(hf_config, key, None)
        if value:
            widths[axis] = int(value)
    return widths


def even_share(total: int, parts: int, index: int) -> Range:
    """Part `index` of `total` units cut into `parts` as evenly as possible: [start, stop)."""
    return total * index // parts, total * (index + 1) // parts


def _split_problem(hf_config, size: int, row_blocks: Mapping[str, int]) -> str | None:
    """Why the model cannot be split over `size` ranks, or None."""
    heads, kv_heads, head_dim, intermediate, vocab = _counts(hf_config)
    if size < 1:
        return "the size must be >= 1"
    if size == 1:
        return None  # nothing is cut
    if size > kv_heads:
        if size % kv_heads:
            return (
                f"more ranks than its {kv_heads} KV heads must be a multiple of them "
                "(each KV head is replicated)"
            )
        if (heads // kv_heads) % (size // kv_heads):
            return (
                f"each KV head's {heads // kv_heads} query heads cannot be split over "
                f"{size // kv_heads} ranks"
            )
    widths = _widths(hf_config)
    for axis, what in (
        ("intermediate", "its MLP's"),
        ("expert_intermediate", "each expert's"),
        ("shared_intermediate", "its shared expert's"),
    ):
        width = widths.get(axis)
        block = row_blocks.get(axis, 1)
        if width is not None and (width % block or width // block < size):
            return (
                f"{what} {width} columns in {block}-value blocks cannot be shared by {size} ranks"
            )
    o_block = row_blocks.get("q_heads", 1)
    for rank in range(size):
        start, stop = _q_kv_heads(heads, kv_heads, size, rank)[0]
        if (start * head_dim) % o_block or (stop * head_dim) % o_block:
            return (
                f"o_proj's {heads * head_dim} columns come in {o_block}-value blocks, and a "
                f"rank's {(stop - start) * head_dim} columns from {start * head_dim} do not "
                "start and end on them"
            )
    if vocab < size:
        return f"its vocabulary of {vocab} is smaller than {size}"
    return None


def _q_kv_heads(heads: int, kv_heads: int, size: int, rank: int) -> tuple[Range, Range]:
    group = heads // kv_heads
    if size <= kv_heads:  # whole KV-head groups, as evenly as they go
        kv = even_share(kv_heads, size, rank)
        return (kv[0] * group, kv[1] * group), kv
    replicas = size // kv_heads  # ranks per KV head, each with a share of its query heads
    kv_head, part = divmod(rank, replicas)
    share = group // replicas
    start = kv_head * group + part * share
    return (start, start + share), (kv_head, kv_head + 1)


def _shard(hf_config, size: int, rank: int, row_blocks: Mapping[str, int]) -> RankShard:
    heads, kv_heads, head_dim, intermediate, vocab = _counts(hf_config)
    q, kv = _q_kv_heads(heads, kv_heads, size, rank)
    block = row_blocks.get("intermediate", 1)
    units = even_share(intermediate // block, size, rank)
    widths = _widths(hf_config)
    experts = {}
    for axis in ("expert_intermediate", "shared_intermediate"):
        if axis in widths:
            axis_block = row_blocks.get(axis, 1)
            share = even_share(widths[axis] // axis_block, size, rank)
            experts[axis] = (share[0] * axis_block, share[1] * axis_block)
    return RankShard(
        rank=rank,
        size=size,
        head_dim=head_dim,
        q_heads=q,
        kv_heads=kv,
        intermediate=(units[0] * block, units[1] * block),
        vocab=even_share(vocab, size, rank),
        vocab_rows=-(-vocab // size),
        totals=(
            ("q_heads", heads),
            ("kv_heads", kv_heads),
            ("intermediate", intermediate),
            ("vocab", vocab),
            *((axis, widths[axis]) for axis in experts),
        ),
        **experts,
    )


def take(shard: RankShard, cut: Cut | None | Literal["zero"], name: str, weight):
    """This rank's slice of a loaded checkpoint tensor (torch.Tensor or QuantWeight) as `cut`
    (RankShard.cut) says. One row range of a QuantWeight stays a view (of a GGUF's map);
    several are concatenated, and column slices copied, cut on block boundaries."""
    import torch

    from pagecli_kernels.quant_formats import QuantWeight, concat_rows

    if cut is None:
        return weight
    if cut == "zero":
        return torch.zeros_like(weight)
    axis, ranges = cut
    if isinstance(weight, QuantWeight):
        fmt = weight.format
        if axis == "rows":
            pieces = [QuantWeight(fmt, weight.data[a:b], weight.cols) for a, b in ranges]
            return pieces[0] if len(pieces) == 1 else concat_rows(pieces)
        start, stop = ranges
        if start % fmt.block_values or stop % fmt.block_values:
            raise SplitError(
                f"{name}: columns {start}..{stop} cut its {fmt.block_values}-value blocks"
            )
        first, last = start // fmt.block_values, stop // fmt.block_values
        data = weight.data[:, first * fmt.block_bytes : last * fmt.block_bytes].contiguous()
        return QuantWeight(fmt, data, stop - start)
    if axis == "rows":
        if len(ranges) == 1:
            return weight[ranges[0][0] : ranges[0][1]]
        return torch.cat([weight[a:b] for a, b in ranges])
    return weight[:, ranges[0] : ranges[1]].contiguous()


def read_slice(shard: RankShard, cut: Cut | None | Literal["zero"], tensor_slice):
    """This rank's slice of a safetensors tensor, reading only that slice from the file
    (`tensor_slice` is safetensors' get_slice object)."""
    import torch

    if cut is None:
        return tensor_slice[:]
    if cut == "zero":  # a bias: small, read whole
        return torch.zeros_like(tensor_slice[:])
    axis, ranges = cut
    if axis == "rows":
        pieces = [tensor_slice[a:b] for a, b in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return tensor_slice[:, ranges[0] : ranges[1]]
