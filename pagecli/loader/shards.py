"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron-style).

q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj by input
columns (row-parallel: each rank's partial sums are added by one all-reduce), the embedding
and the output projection by vocabulary rows (vocab-parallel). Norms are replicated.

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

from pagecli.loader.resolve import ModelLoadError

Range = tuple[int, int]  # [start, stop)
Cut = tuple[Literal["rows", "cols"], int, int]

MAX_SIZE_LISTED = 64  # the valid sizes a SplitError lists go up to this


class SplitError(ModelLoadError):
    """The model cannot be split over this many ranks (one line, with the sizes that work)."""


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
        return local

    def cut(self, name: str) -> Cut | None | Literal["zero"]:
        """How to take checkpoint tensor `name` (transformers' name): rows or columns
        [start, stop), "zero" (a row-parallel bias, added once: by rank 0), or None (whole)."""
        name = name.removeprefix("model.")
        d = self.head_dim
        if ".q_proj." in name:
            return ("rows", self.q_heads[0] * d, self.q_heads[1] * d)
        if ".k_proj." in name or ".v_proj." in name:
            return ("rows", self.kv_heads[0] * d, self.kv_heads[1] * d)
        if ".gate_proj." in name or ".up_proj." in name:
            return ("rows", *self.intermediate)
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return ("rows", *self.vocab)
        row_parallel = {".o_proj.": (self.q_heads[0] * d, self.q_heads[1] * d)}
        row_parallel[".down_proj."] = self.intermediate
        for fragment, (start, stop) in row_parallel.items():
            if fragment in name:
                if name.endswith(".bias"):
                    return None if self.rank == 0 else "zero"
                return ("cols", start, stop)
        return None


def plan_shards(
    hf_config, size: int, block_values: Mapping[str, int] | None = None
) -> list[RankShard]:
    """Every rank's shard of a model split over `size` ranks. `block_values` maps the
    checkpoint names of block-format tensors to their block width (columns that must not be
    cut). SplitError, naming the sizes that work, when `size` cannot be honoured."""
    problem = _split_problem(hf_config, size, block_values or {})
    if problem is None:
        return [_shard(hf_config, size, rank, block_values or {}) for rank in range(size)]
    works = [
        n
        for n in range(1, MAX_SIZE_LISTED + 1)
        if _split_problem(hf_config, n, block_values or {}) is None
    ]
    raise SplitError(
        f"--tensor-parallel-size {size} cannot split this model: {problem} "
        f"(sizes that work: {', '.join(map(str, works)) or 'none'})"
    )


def _counts(hf_config) -> tuple[int, int, int, int, int]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim, hf_config.intermediate_size, hf_config.vocab_size


def _widest_block(block_values: Mapping[str, int], fragment: str) -> int:
    return max((v for k, v in block_values.items() if fragment in k), default=1)


def even_share(total: int, parts: int, index: int) -> Range:
    """Part `index` of `total` units cut into `parts` as evenly as possible: [start, stop)."""
    return total * index // parts, total * (index + 1) // parts


def _split_problem(hf_config, size: int, block_values: Mapping[str, int]) -> str | None:
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
    mlp_block = _widest_block(block_values, ".down_proj.")
    if intermediate % mlp_block or intermediate // mlp_block < size:
        return (
            f"its MLP's {intermediate} columns in {mlp_block}-value blocks cannot be shared "
            f"by {size} ranks"
        )
    o_block = _widest_block(block_values, ".o_proj.")
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


def _shard(hf_config, size: int, rank: int, block_values: Mapping[str, int]) -> RankShard:
    heads, kv_heads, head_dim, intermediate, vocab = _counts(hf_config)
    q, kv = _q_kv_heads(heads, kv_heads, size, rank)
    block = _widest_block(block_values, ".down_proj.")
    units = even_share(intermediate // block, size, rank)
    return RankShard(
        rank=rank,
        size=size,
        head_dim=head_dim,
        q_heads=q,
        kv_heads=kv,
        intermediate=(units[0] * block, units[1] * block),
        vocab=even_share(vocab, size, rank),
        vocab_rows=-(-vocab // size),
    )


def take(shard: RankShard, name: str, weight):
    """This rank's slice of a loaded checkpoint tensor (torch.Tensor or QuantWeight). Row
    slices of a QuantWeight stay views (of a GGUF's map); column slices are copied, cut on
    block boundaries."""
    import torch

    from pagecli_kernels.quant_formats import QuantWeight

    cut = shard.cut(name)
    if cut is None:
        return weight
    if cut == "zero":
        return torch.zeros_like(weight)
    axis, start, stop = cut
    if isinstance(weight, QuantWeight):
        if axis == "rows":
            return QuantWeight(weight.format, weight.data[start:stop], weight.cols)
        fmt = weight.format
        if start % fmt.block_values or stop % fmt.block_values:
            raise SplitError(
                f"{name}: columns {start}..{stop} cut its {fmt.block_values}-value blocks"
            )
        first, last = start // fmt.block_values, stop // fmt.block_values
        data = weight.data[:, first * fmt.block_bytes : last * fmt.block_bytes].contiguous()
        return QuantWeight(fmt, data, stop - start)
    if axis == "rows":
        return weight[start:stop]
    return weight[:, start:stop].contiguous()


def read_slice(shard: RankShard, name: str, tensor_slice):
    """This rank's slice of a safetensors tensor, reading only that slice from the file
    (`tensor_slice` is safetensors' get_slice object)."""
    import torch  # noqa: F401 - the slices are torch tensors

    cut = shard.cut(name)
    if cut is None:
        return tensor_slice[:]
    if cut == "zero":  # a bias: small, read whole
        return torch.zeros_like(tensor_slice[:])
    axis, start, stop = cut
    return tensor_slice[start:stop] if axis == "rows" else tensor_slice[:, start:stop]
