"""The shared-memory collectives of tensor-parallel ranks (pagecli_kernels/shm_collective.py)
between real processes: sums in rank order on every rank, gathers, reuse of the two banks
over many rounds, and a wait that ends (aborted or timed out) instead of hanging."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from pagecli_kernels import shm_collective

pytestmark = pytest.mark.skipif(
    not shm_collective.available(), reason="the native library is not built here"
)
SLOT = 1024


def _rank(path: str, rank: int, size: int, rounds: int, out) -> None:
    from pagecli_kernels.shm_collective import ShmCollective

    shm = ShmCollective(path, rank, size, SLOT, timeout_s=30)
    sums, gathers = [], []
    for i in range(rounds):
        gen = torch.Generator().manual_seed(1000 * i + rank)
        n = 1 + (37 * i) % SLOT  # a different length every round
        x = torch.randn(n, generator=gen)
        sums.append(shm.all_reduce(x.clone()).numpy())  # numpy: plain pickles through the queue
        g = shm.gather(x[: n // 2 + 1].contiguous())
        gathers.append(None if g is None else g.numpy())
    out.put((rank, sums, gathers))


def test_all_reduce_and_gather_over_many_rounds(tmp_path):
    size, rounds = 3, 40
    path = str(tmp_path / "collectives")
    shm_collective.create(path, size, SLOT)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(path, r, size, rounds, out)) for r in range(size)]
    for p in procs:
        p.start()
    results = dict((r, (s, g)) for r, s, g in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    for i in range(rounds):
        n = 1 + (37 * i) % SLOT
        xs = [
            torch.randn(n, generator=torch.Generator().manual_seed(1000 * i + r))
            for r in range(size)
        ]
        expected = xs[0].clone()
        for x in xs[1:]:
            expected += x  # rank order
        for rank in range(size):
            assert torch.equal(torch.from_numpy(results[rank][0][i]), expected)  # same bits
        gathered = torch.from_numpy(results[0][1][i])
        assert torch.equal(gathered, torch.stack([x[: n // 2 + 1] for x in xs]))
        assert results[1][1][i] is None and results[2][1][i] is None


def test_a_wait_ends_on_abort_and_on_its_time_limit(tmp_path):
    path = str(tmp_path / "collectives")
    shm_collective.create(path, 2, SLOT)
    lonely = shm_collective.ShmCollective(path, 0, 2, SLOT, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(shm_collective.CollectiveError, match="did not come in 0.3 s"):
        lonely.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5
    other = shm_collective.ShmCollective(path, 1, 2, SLOT, timeout_s=30)
    other.abort()  # as rank 0's watcher does when a worker dies
    with pytest.raises(shm_collective.CollectiveError, match="aborted"):
        lonely.all_reduce(torch.ones(4))
    assert not lonely.takes(torch.ones(SLOT + 1)) and not lonely.takes(torch.ones(4).double())
