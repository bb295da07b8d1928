"""Tensor-parallel ranks: rank 0 is the engine's own process (scheduler, block manager,
sampling); ranks 1..N-1 are worker processes, started here (spawn), that only run steps.

Each step, rank 0 sends the workers the step's flat inputs (`StepInputs`: token ids,
positions, slot mapping, block tables, lengths, block copies; numpy arrays over a pipe,
never Sequence objects), then every rank runs the forward pass on its shard and meets the
others in the collectives of layers/parallel.py (gloo on the CPU, NCCL on CUDA; rendezvous
through a fresh file per engine, never a fixed port).

Faults: a worker that raises sends its one-line reason and exits; one that dies closes its
sockets, so rank 0's next collective fails at once. Either way rank 0 raises `WorkerFailed`
naming the rank and the cause; a watcher thread also reports a death between steps (serve).
Workers ignore Ctrl-C (rank 0 ends them), die with rank 0 (PR_SET_PDEATHSIG), and are
stopped, then killed, when the engine closes or the process exits: no orphans.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from pagecli.config import EngineConfig

INIT_TIMEOUT_S = 600  # loading a large shard can take minutes; a dead worker is seen sooner
COLLECTIVE_TIMEOUT_S = 120  # a rank that hangs (not dies) mid-step
STOP_TIMEOUT_S = 5.0


class WorkerFailed(RuntimeError):
    """A tensor-parallel worker died or raised: the engine cannot go on (one line)."""


@dataclass
class StepInputs:
    """One step's flat inputs, as every rank needs them: numpy copies of the model's inputs
    and of AttentionMetadata's fields, and the step's block copies."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    sample_index: np.ndarray  # [S] int64
    meta: dict  # AttentionMetadata's fields: arrays (or None), num_decode_tokens an int
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    drafts: bool = False  # speculative decoding: the step checks drafts (verify_kernels)

    @classmethod
    def from_step(cls, input_ids, positions, meta, sample_index, batch) -> StepInputs:
        """Copies of the step's tensors (the host buffers are reused next step)."""
        from pagecli.layers.attention import AttentionMetadata

        def host(value):
            if not isinstance(value, torch.Tensor):
                return value
            return value.detach().cpu().numpy().copy()

        fields = {
            f.name: host(getattr(meta, f.name)) for f in dataclasses.fields(AttentionMetadata)
        }
        return cls(
            host(input_ids),
            host(positions),
            host(sample_index),
            fields,
            list(batch.swap_out),
            list(batch.swap_in),
            list(batch.block_copies),
            any(s.draft_token_ids for s in batch.seqs),
        )

    def tensors(self, device: torch.device):
        """(input_ids, positions, AttentionMetadata, sample_index) on `device`."""
        from pagecli.layers.attention import AttentionMetadata

        def dev(value):
            if not isinstance(value, np.ndarray):
                return value
            return torch.from_numpy(value).to(device)

        meta = AttentionMetadata(**{name: dev(value) for name, value in self.meta.items()})
        return dev(self.input_ids), dev(self.positions), meta, dev(self.sample_index)


@dataclass(frozen=True)
class WorkerLink:
    """What a worker needs to join its engine: its rank, the rendezvous file, the shared
    memory file of the CPU's collectives, and its pipe."""

    rank: int
    size: int
    init_file: str
    shm_file: str | None
    slot_floats: int
    conn: object  # multiprocessing Connection to rank 0


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(rank: int, size: int, init_file: str, device: torch.device) -> None:
    """Join the engine's process group (blocks until every rank has joined)."""
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend(device),
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group (a dead peer) is gone either way
            pass


def _check_no_other_group() -> None:
    """torch.distributed holds one process group per process: one tensor-parallel engine at a
    time (a dropped one's group goes once it is collected)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
    if dist.is_available() and dist.is_initialized():
        raise ValueError(
            "another tensor-parallel engine runs in this process: close it first "
            "(llm.engine.close())"
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one asked for on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def numa_cpus(node: int, root: Path = Path("/sys/devices/system/node")) -> set[int] | None:
    """The CPUs of NUMA node `node` (None where the machine has no such node)."""
    from pagecli.engine.cpu_threads import parse_cpu_list

    try:
        return set(parse_cpu_list((root / f"node{node}" / "cpulist").read_text()))
    except OSError:
        return None


def num_numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int:
    return len(list(root.glob("node[0-9]*"))) or 1


def pin_to_numa_node(rank: int, size: int) -> None:
    """`--numa`: run rank r on the CPUs of NUMA node r; ValueError where there are fewer
    nodes than ranks."""
    nodes = num_numa_nodes()
    cpus = numa_cpus(rank) if nodes >= size else None
    if not cpus:
        raise ValueError(
            f"--numa pins rank r to NUMA node r: {size} ranks need {size} nodes, this machine "
            f"has {nodes}"
        )
    os.sched_setaffinity(0, cpus)


def shm_folder(num_bytes: int) -> str | None:
    """/dev/shm where it has room for `num_bytes` (a container's may be 64 MiB: touching a page
    past its size is a SIGBUS), else None (the temporary directory)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stat.f_bavail * stat.f_frsize > 2 * num_bytes else None


def attach_shm(tp, link_or_group, device: torch.device) -> None:
    """Give a CPU rank's collectives the shared memory segment (when the native library is
    there; gloo carries them otherwise)."""
    from pagecli_kernels import shm_collective

    path = link_or_group.shm_file
    if device.type != "cpu" or path is None:
        return
    tp.attach(
        shm_collective.ShmCollective(
            path, tp.rank, tp.size, link_or_group.slot_floats, COLLECTIVE_TIMEOUT_S
        )
    )


class ParallelGroup:
    """Rank 0's handle on its workers: start, per-step inputs, faults, shutdown."""

    def __init__(self, size: int, device: torch.device, slot_floats: int) -> None:
        from pagecli_kernels import shm_collective

        _check_no_other_group()
        self.size = size
        self.slot_floats = slot_floats
        self.shm_file: str | None = None
        shm_bytes = 0
        wanted = os.environ.get("PAGECLI_SHM_COLLECTIVES", "1") != "0"  # 0: gloo for all
        if device.type == "cpu" and wanted and shm_collective.available():
            shm_bytes = shm_collective.file_bytes(size, slot_floats)
        self._dir = tempfile.mkdtemp(prefix="pagecli-tp-", dir=shm_folder(shm_bytes))
        self.init_file = os.path.join(self._dir, "rendezvous")  # fresh: never reused
        if shm_bytes:
            self.shm_file = os.path.join(self._dir, "collectives")
            shm_collective.create(self.shm_file, size, slot_floats)
        self.processes: list = []
        self.conns: list = []
        self.failure: WorkerFailed | None = None  # set once a worker is known to be gone
        self._callbacks: list[Callable[[WorkerFailed], None]] = []
        self._lock = threading.Lock()  # failed() runs on the engine and the watcher threads
        # read by the finalizer and the watcher thread; "joined": this group made the
        # process's torch.distributed group (and so may destroy it)
        self._shared = {"closing": False, "joined": False}
        # runs at close(), when the engine is collected, or at exit: never an orphan worker
        self._finalizer = weakref.finalize(
            self, _shutdown, self.processes, self.conns, self._dir, self._shared
        )

    def start(
        self,
        runner_class: type,
        config: EngineConfig,
        hf_config,
        source,
        device: torch.device,
        dtype,
        max_len: int,
    ) -> None:
        """Spawn ranks 1..N-1; each builds a `runner_class` over its shard (loading it while
        this process loads its own) and runs its steps. The class comes from the caller, so
        that this module does not import the model runner that uses it."""
        import multiprocessing as mp
        from multiprocessing import resource_tracker

        ctx = mp.get_context("spawn")
        # started by the first spawn otherwise, and it unblocks SIGINT after its own start,
        # inside the window below
        resource_tracker.ensure_running()
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            link = WorkerLink(
                rank, self.size, self.init_file, self.shm_file, self.slot_floats, child
            )
            proc = ctx.Process(
                target=worker_main,
                args=(
                    runner_class,
                    link,
                    (config, hf_config, source, device, dtype, max_len),
                    os.getpid(),
                ),
                name=f"pagecli-tp-rank{rank}",
                daemon=True,
            )
            # a Ctrl-C at the terminal reaches the whole process group: the worker must not
            # see it while it starts (the blocked mask outlives exec; worker_main ignores it)
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
            child.close()
            self.processes.append(proc)
            self.conns.append(parent)

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard; ModelLoadError naming the rank when
        one fails to (its own one-line reason)."""
        from multiprocessing.connection import wait

        from pagecli.loader.resolve import ModelLoadError

        pending = dict(enumerate(self.conns, start=1))
        deadline = time.monotonic() + INIT_TIMEOUT_S
        while pending:
            sentinels = {self.processes[r - 1].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], timeout=deadline - time.monotonic())
            if not ready:
                raise ModelLoadError(f"tensor-parallel ranks {sorted(pending)} did not load")
            for obj in ready:
                rank = sentinels.get(obj) or next(r for r, c in pending.items() if c is obj)
                if rank not in pending:
                    continue
                message = self._receive(rank)
                if message == ("loaded",):
                    del pending[rank]
                    continue
                raise ModelLoadError(self._describe(rank, message))

    def start_join(self) -> None:
        """Every shard is loaded: tell the workers to join the process group (they wait for
        this, so that no rank's join times out while another still loads)."""
        self._shared["joined"] = True
        self.send(("join",))

    def release_files(self) -> None:
        """Every rank has joined and mapped the shared memory: remove the files now, so that
        nothing is left behind however this process ends (the maps stay valid)."""
        shutil.rmtree(self._dir, ignore_errors=True)

    def watch(self) -> None:
        """Start the thread that notices a worker dying between steps (it holds the group
        weakly: a dropped engine's group is still collected, and its workers stopped)."""
        sentinels = [p.sentinel for p in self.processes]
        args = (weakref.ref(self), sentinels, self._shared)
        threading.Thread(target=_watch, args=args, name="pagecli-tp-watch", daemon=True).start()

    def on_failure(self, callback: Callable[[WorkerFailed], None]) -> None:
        """Call `callback(error)` (from the watcher thread) when a worker dies."""
        self._callbacks.append(callback)

    def send(self, message: StepInputs | tuple) -> None:
        """Hand every worker a step's inputs (or a control message); WorkerFailed for a
        worker whose pipe is gone."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, OSError):
                raise self.failed(rank) from None

    def failed(self, rank: int | None = None) -> WorkerFailed:
        """The error for a worker that is gone (the first one found when `rank` is None)."""
        with self._lock:
            return self._failed(rank)

    def _failed(self, rank: int | None) -> WorkerFailed:
        if self.failure is not None:
            return self.failure
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while rank is None and time.monotonic() < deadline:
            for r, conn in enumerate(self.conns, start=1):
                if not self.processes[r - 1].is_alive() or conn.poll():
                    rank = r
                    break
            else:
                time.sleep(0.05)
        if rank is None:
            self.failure = WorkerFailed("a tensor-parallel collective failed; no worker died")
            return self.failure
        self.processes[rank - 1].join(STOP_TIMEOUT_S)
        self.failure = WorkerFailed(self._describe(rank, self._receive(rank)))
        return self.failure

    def close(self) -> None:
        """Stop every worker (then kill what is left) and leave the process group."""
        self._finalizer()

    # ---- inside ---------------------------------------------------------------------------

    def _receive(self, rank: int):
        conn = self.conns[rank - 1]
        try:
            return conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            return None

    def _describe(self, rank: int, message) -> str:
        if isinstance(message, tuple) and message and message[0] == "error":
            return f"tensor-parallel rank {rank} failed: {message[1]}"
        proc = self.processes[rank - 1]
        proc.join(STOP_TIMEOUT_S)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                cause = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                cause = f"killed by signal {-code}"
        elif code is not None:
            cause = f"exited with status {code}"
        else:
            cause = "stopped answering"
        return f"tensor-parallel rank {rank} died ({cause})"


def _watch(group_ref, sentinels: list, shared: dict) -> None:
    from multiprocessing.connection import wait

    while not shared["closing"]:
        done = wait(sentinels, timeout=1.0)
        group = group_ref()
        if group is None or shared["closing"]:
            return
        if done:
            error = group.failed(sentinels.index(done[0]) + 1)
            for callback in group._callbacks:
                callback(error)
            return
        del group


def _shutdown(processes: list, conns: list, folder: str, shared: dict) -> None:
    """Ask each worker to stop, wait a little, then kill what is left; leave the group."""
    shared["closing"] = True
    for conn in conns:
        try:
            conn.send(None)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
    if shared["joined"]:
        leave_group()
    shutil.rmtree(folder, ignore_errors=True)


# ---- the worker process -----------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Be killed when rank 0 dies, however it dies (Linux); elsewhere the pipe's EOF ends us."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # rank 0 died before the line above
        os._exit(1)


def worker_main(runner_class: type, link: WorkerLink, runner_args: tuple, parent_pid: int) -> None:
    """A worker rank: build its runner (`runner_class(*runner_args, link=link)`: it loads the
    shard and joins the group), then run steps until told to stop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    conn = link.conn
    try:
        import warnings

        warnings.simplefilter("ignore")
        runner = runner_class(*runner_args, link=link)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0 in one line
        _report(conn, exc)
        os._exit(1)
    try:
        while True:
            try:
                step = conn.recv()
            except (EOFError, OSError):
                break
            if step is None:
                break
            runner.run_worker_step(step)
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0 in one line
        _report(conn, exc)
        os._exit(1)
    leave_group()
    os._exit(0)


def _report(conn, exc: BaseException) -> None:
    text = str(exc).strip().splitlines()
    try:
        conn.send(("error", f"{type(exc).__name__}: {text[0] if text else ''}"))
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass
