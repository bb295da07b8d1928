"""EngineStats: plain-data snapshots of the engine, for the CLI's stats lines and display."""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pagecli_kernels.settings import report as kernel_report

if TYPE_CHECKING:
    from pagecli.engine.scheduler import ScheduledBatch


class EngineParts(Protocol):
    """What a snapshot reads of the engine (LLMEngine has these; named here so that this
    module does not import the engine)."""

    block_manager: Any
    scheduler: Any
    timer: StepTimer
    config: Any


class StepTimer:
    """Keeps the totals and a short window of recent steps (for tokens/s and step time)."""

    def __init__(self, window: int = 32) -> None:
        self.recent: deque[tuple[float, int, int]] = deque(maxlen=window)  # (s, prefill, decode)
        self.total_prefill_tokens = 0
        self.total_decode_tokens = 0
        self.total_time = 0.0
        self.num_steps = 0

    @contextmanager
    def step(self):
        start = time.perf_counter()
        seen: list[tuple[ScheduledBatch, list | None]] = []
        yield lambda batch, samples=None: seen.append((batch, samples))
        if not seen:
            return
        batch, samples = seen[0]
        elapsed = time.perf_counter() - start
        prefill = sum(s.num_new_tokens for s in batch.prefills)
        # decoded tokens: one per decode, or what a speculative decode emitted
        decodes = len(batch.decodes)
        decode = sum(len(s.token_ids) for s in samples[:decodes]) if samples else decodes
        self.recent.append((elapsed, prefill, decode))
        self.total_prefill_tokens += prefill
        self.total_decode_tokens += decode
        self.total_time += elapsed
        self.num_steps += 1


@dataclass(frozen=True)
class EngineStats:
    """What the engine is doing right now, as numbers."""

    num_blocks: int
    block_size: int
    blocks_in_use: int
    blocks_cached_free: int
    blocks_free: int
    blocks_shared: int
    blocks_swapped: int
    tokens_held: int  # tokens whose K/V sit in in-use blocks (per sequence, shared counted once)
    num_running: int
    num_waiting: int
    num_swapped: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    cow_copies: int
    evictions: int
    preemptions_recompute: int
    preemptions_swap: int
    chunked_prefills: int
    num_steps: int
    prefill_tokens: int
    decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    step_time_s: float
    block_states: tuple[str, ...]  # per block: "free", "used", "shared", "cached"
    tensor_parallel_size: int = 1
    tp_comm_s: float = 0.0  # rank 0's time in all-reduces and gathers since the start
    # the CPU kernels' choices in effect, resolved (pagecli_kernels.settings.report)
    kernels: dict[str, object] = field(default_factory=dict)
    # speculative decoding: decodes that carried drafts, their drafts, the drafts accepted
    # (in all, and at each draft position)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # KV cache groups (engine/kv_groups.py): each table's kind ("full attention",
    # "window 512") and the blocks it holds now; blocks window tables gave back early
    kv_groups: tuple[str, ...] = ("full attention",)
    group_blocks_in_use: tuple[int, ...] = ()
    window_freed_blocks: int = 0
    # recurrent layers (Gated DeltaNet): state slots (one per running sequence), snapshots
    # kept for prefix hits, and snapshots saved since the start
    state_slots: int = 0
    state_slots_in_use: int = 0
    state_snapshots: int = 0
    state_snapshots_held: int = 0
    state_snapshots_saved: int = 0
    # the weights' bytes, and the bytes one decode token reads of them (a mixture of experts:
    # its chosen experts' share; the bandwidth floor of a token is these over the bandwidth)
    weight_bytes: int = 0
    active_weight_bytes: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted drafts / drafts."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a checked decode emitted, on average: its accepted drafts, plus one."""
        return 1 + self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    def as_dict(self) -> dict:
        data = asdict(self)
        data.pop("block_states")
        data["prefix_hit_rate"] = self.prefix_hit_rate
        data["spec_acceptance_rate"] = self.spec_acceptance_rate
        data["spec_mean_accepted_length"] = self.spec_mean_accepted_length
        return data

    @classmethod
    def snapshot(cls, engine: EngineParts) -> EngineStats:
        bm = engine.block_manager
        sched = engine.scheduler
        timer = engine.timer
        states = []
        cached = bm.cached_free_ids
        for block in bm.blocks:
            if block.ref_count > 1:
                states.append("shared")
            elif block.ref_count == 1:
                states.append("used")
            elif block.block_id in cached:
                states.append("cached")
            else:
                states.append("free")
        states += ["free"] * bm.num_unused_blocks  # the blocks never handed out
        held_blocks: dict[int, int] = {}
        for seq in sched.running:
            for i, block_id in enumerate(seq.block_table):
                if block_id < 0:  # a window table's given-back block
                    continue
                filled = min(engine.config.block_size, seq.num_computed_tokens - i * bm.block_size)
                held_blocks[block_id] = max(held_blocks.get(block_id, 0), max(filled, 0))
        window = sum(t for t, _, _ in timer.recent)
        return cls(
            num_blocks=bm.num_blocks,
            block_size=bm.block_size,
            blocks_in_use=bm.num_used_blocks,
            blocks_cached_free=bm.num_cached_free_blocks,
            blocks_free=bm.num_free_blocks - bm.num_cached_free_blocks,
            blocks_shared=states.count("shared"),
            blocks_swapped=bm.num_swapped_blocks,
            tokens_held=sum(held_blocks.values()),
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            prefix_query_tokens=bm.counters.prefix_query_tokens,
            prefix_hit_tokens=bm.counters.prefix_hit_tokens,
            cow_copies=bm.counters.cow_copies,
            evictions=bm.counters.evictions,
            preemptions_recompute=sched.counters.preemptions_recompute,
            preemptions_swap=sched.counters.preemptions_swap,
            chunked_prefills=sched.counters.chunked_prefills,
            num_steps=timer.num_steps,
            prefill_tokens=timer.total_prefill_tokens,
            decode_tokens=timer.total_decode_tokens,
            prefill_tokens_per_s=sum(p for _, p, _ in timer.recent) / window if window else 0.0,
            decode_tokens_per_s=sum(d for _, _, d in timer.recent) / window if window else 0.0,
            step_time_s=window / len(timer.recent) if timer.recent else 0.0,
            block_states=tuple(states),
            tensor_parallel_size=engine.config.tensor_parallel_size,
            tp_comm_s=engine.runner.tp.comm_seconds if engine.runner.tp is not None else 0.0,
            kernels=kernel_report(),
            spec_drafts=sched.counters.spec_drafts,
            spec_draft_tokens=sched.counters.spec_draft_tokens,
            spec_accepted_tokens=sched.counters.spec_accepted_tokens,
            spec_accepted_per_position=tuple(sched.counters.spec_accepted_per_position),
            kv_groups=tuple(group.kind for group in bm.groups),
            group_blocks_in_use=tuple(bm.used_blocks_by_group()),
            window_freed_blocks=bm.counters.window_freed,
            state_slots=bm.num_state_slots,
            state_slots_in_use=bm.num_state_slots - bm.num_free_state_slots,
            state_snapshots=bm.num_snapshots,
            state_snapshots_held=bm.num_snapshots_held,
            state_snapshots_saved=bm.counters.snapshots_saved,
            weight_bytes=getattr(engine.runner, "weight_bytes", 0),
            active_weight_bytes=getattr(engine.runner, "active_weight_bytes", 0),
        )
