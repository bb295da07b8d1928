"""The collectives of a tensor-parallel model: the all-reduce after each row-parallel
projection, the vocab-parallel embedding lookup, and the logits gathered to rank 0.

torch.distributed carries them (NCCL on CUDA, gloo on the CPU); on the CPU, tensors that fit
go through a shared memory segment instead (pagecli_kernels/shm_collective.py), since gloo
takes about a millisecond per collective between processes of one host. The process group
and the segment are set up by engine/parallel.py; the layers only call these.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pagecli.loader.shards import RankShard, even_share
from pagecli_kernels.shm_collective import ShmCollective


class TensorParallel:
    """A rank's view of the group: its shard, the collectives, and the time spent in them."""

    def __init__(self, shard: RankShard) -> None:
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size
        self._seconds = 0.0  # wall time inside the collectives made here
        self._count = 0  # collectives made here
        self.shm: ShmCollective | None = None  # set by attach() on the CPU

    @property
    def comm_seconds(self) -> float:
        """Wall time inside collectives since the start (the one-call layers' included)."""
        return self._seconds + (self.shm.seconds_in_layers if self.shm is not None else 0.0)

    @property
    def num_collectives(self) -> int:
        """All-reduces and gathers since the start (the one-call layers' included)."""
        return self._count + (self.shm.num_in_layers if self.shm is not None else 0)

    def attach(self, shm: ShmCollective) -> None:
        """Carry the CPU's collectives that fit through this shared memory segment."""
        self.shm = shm

    def abort(self) -> None:
        """End the collectives the ranks are waiting in (a rank has died)."""
        if self.shm is not None:
            self.shm.abort()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place. gloo adds float32 only (its float16/bfloat16
        sums are slow or missing): other dtypes on the CPU are summed in float32."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.takes(x):
            self.shm.all_reduce(x)
        elif x.device.type == "cpu" and x.dtype != torch.float32:
            wide = x.float()
            dist.all_reduce(wide)
            x.copy_(wide)
        else:
            dist.all_reduce(x)
        self._seconds += time.perf_counter() - start
        self._count += 1
        return x

    def embed(self, embedding: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """A vocab-parallel lookup: each rank looks up the ids in its rows (zeros elsewhere)
        and the ranks' rows are summed; one rank holds each id, so the sum is exact."""
        start, stop = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < stop)  # [T]
        local = torch.where(mine, input_ids - start, torch.zeros_like(input_ids))
        hidden = embedding(local)  # [T, H]
        hidden[~mine] = 0
        return self.all_reduce(hidden)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits of its vocabulary rows ([S, rows] float32) joined on rank 0
        into [S, vocab_size]; None on the other ranks."""
        start = time.perf_counter()
        rows = self.shard.vocab_rows
        if logits.shape[1] < rows:  # the first ranks may hold one row fewer
            pad = logits.new_zeros(logits.shape[0], rows - logits.shape[1])
            logits = torch.cat([logits, pad], dim=1)
        logits = logits.contiguous()
        if self.shm is not None and self.shm.takes(logits):
            stacked = self.shm.gather(logits)  # [size, S, rows] on rank 0
            parts = None if stacked is None else list(stacked)
        else:
            parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(logits, parts, dst=0)
        self._seconds += time.perf_counter() - start
        self._count += 1
        if parts is None:
            return None
        shares = [even_share(vocab_size, self.size, r) for r in range(self.size)]
        return torch.cat([p[:, : stop - start] for p, (start, stop) in zip(parts, shares)], 1)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' `value`s, on every rank (`device`: the group's, NCCL
        takes only CUDA tensors)."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
