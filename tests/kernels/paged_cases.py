"""Random paged-attention inputs for the kernel tests: shuffled block tables, NaN poison."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from pagecli_kernels import reference

# Tolerances against the float64 reference, per dtype (atol, rtol).
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedCase:
    """One batch: caches with every unowned slot NaN, queries, and the metadata tensors."""

    query: torch.Tensor  # [num_tokens, num_heads, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 2,
) -> PagedCase:
    """Build a batch; sequence i holds seq_lens[i] tokens, the last query_lens[i] of them new.

    Blocks are handed out in a random order; spare (never owned) blocks and the tails of
    partly filled blocks stay NaN, and block table padding points at a spare block.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm[-1]  # a block nobody owns (spare_blocks >= 1)
    block_tables = torch.full((len(seq_lens), max_blocks), spare, dtype=torch.int32)
    next_block = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(perm[next_block : next_block + n])
        next_block += n

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        kv_shape = (seq_len, num_kv_heads, head_dim)
        key = torch.randn(kv_shape, generator=gen).to(dtype)
        value = torch.randn(kv_shape, generator=gen).to(dtype)
        reference.store_kv(key, value, k_cache, v_cache, slots)

    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_kv_heads * group, head_dim), generator=gen).to(dtype)
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    device = os.environ.get("PAGECLI_KERNEL_TEST_DEVICE", "cpu")
    return PagedCase(
        query=query.to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=starts.to(device),
        scale=head_dim**-0.5,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Compare with the tolerance of the dtype; NaN anywhere fails."""
    assert actual.dtype == expected.dtype
    assert not torch.isnan(actual).any(), "NaN in the result: an unowned slot was read"
    atol, rtol = TOLERANCES[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def poison_before_window(case: PagedCase, window: int) -> None:
    """Write NaN into every cached position that no new token of its sequence sees through
    a `window`: a kernel that reads outside the window then returns NaN."""
    block_size = case.k_cache.shape[1]
    lens = case.seq_lens.tolist()
    starts = case.query_start_loc.tolist()
    for i, seq_len in enumerate(lens):
        query_len = starts[i + 1] - starts[i]
        first_seen = max(0, seq_len - query_len - window + 1)
        for pos in range(first_seen):
            block = int(case.block_tables[i, pos // block_size])
            case.k_cache[block, pos % block_size] = float("nan")
            case.v_cache[block, pos % block_size] = float("nan")
