"""Continuous batching: admit, chunk prefills, preempt, finish.

Each step is planned under two budgets, `max_num_seqs` running sequences and
`max_num_batched_tokens` new tokens. Running sequences go first (oldest first: a decode is one
token, an unfinished prefill continues with its next chunk), then waiting sequences are
admitted while blocks and budget last. When a running sequence cannot get a block, the most
recently admitted sequence is preempted (recompute: its blocks are released and it goes back to
the front of the waiting queue; swap: its blocks move to host memory).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from pagecli.config import EngineConfig
from pagecli.engine.block_manager import BlockManager
from pagecli.engine.sequence import FinishReason, Sequence, SequenceStatus
from pagecli.engine.structured import advance
from pagecli.outputs import TokenLogprob

# A waiting sequence whose prompt continues with at least this many blocks that another
# sequence computes in this very step waits one step and finds them cached; fewer are
# cheaper to recompute than to wait for.
MIN_BLOCKS_TO_WAIT_FOR = 2


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prefill(self) -> bool:
        """True when this chunk brings the sequence up to date, so its last logits are sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    """One step's work. Decodes (one new token) come first in the flattened batch."""

    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_new_tokens for s in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class SchedulerCounters:
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    chunked_prefills: int = 0  # prefill chunks that did not finish their prompt
    steps: int = 0
    # sequences recomputed whole as they grew past a LongRoPE model's original context
    long_context_restarts: int = 0


class Scheduler:
    """Decides, every step, which sequences run and how many tokens each computes."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: set[int],
        restart_past: int | None = None,
    ) -> None:
        """`restart_past`: a sequence that grows past this many tokens has its whole K/V
        recomputed (a LongRoPE model rotates long sequences with other factors, every token
        of them: transformers' generate drops its cache there too); None: never."""
        self.config = config
        self.restart_past = restart_past
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._seq_ids = itertools.count()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.counters = SchedulerCounters()

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def all_seqs(self) -> list[Sequence]:
        """Every unfinished sequence (those holding block tables are among them)."""
        return [*self.running, *self.waiting, *self.swapped]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        preempted = False
        bm = self.block_manager

        # Hashes of the full blocks this step computes: a waiting sequence whose next uncached
        # blocks are among them (MIN_BLOCKS_TO_WAIT_FOR or more) waits a step and then finds
        # them cached, instead of computing the same prefix twice (a shared system prompt).
        in_flight: set[int] = set()

        # 1. Running sequences, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not bm.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim, batch)
                preempted = True
                if victim is seq:
                    break
            else:
                self._add_to_batch(batch, seq, num_new)
                self._note_in_flight(in_flight, seq, num_new)
                budget -= num_new
                i += 1
                continue
            break

        # 2. Swapped sequences come back before anything new is admitted.
        while self.swapped and not preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not bm.can_swap_in(seq) or budget <= 0:
                break
            self.swapped.popleft()
            batch.swap_in.extend(bm.swap_in(seq))
            seq.status = SequenceStatus.RUNNING
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not bm.allocate_slots(seq, num_new):
                # Room for its blocks but not its next token: it runs next step.
                self.running.append(seq)
                break
            self.running.append(seq)
            self._add_to_batch(batch, seq, num_new)
            budget -= num_new

        # 3. Admit waiting sequences while blocks and budget last.
        while (
            self.waiting
            and not self.swapped
            and not preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_table:
                if bm.num_in_flight_blocks(seq, in_flight) >= MIN_BLOCKS_TO_WAIT_FOR:
                    break
                num_hit = bm.match_prefix(seq)
                if seq.num_output_tokens == 0 and seq.num_cached_tokens == 0:
                    seq.num_cached_tokens = num_hit
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not bm.allocate_slots(seq, num_new):
                bm.free(seq)  # give back the prefix hits; they stay cached
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add_to_batch(batch, seq, num_new)
            self._note_in_flight(in_flight, seq, num_new)
            budget -= num_new

        batch.block_copies = bm.take_pending_copies()
        self.counters.steps += 1
        return batch

    def _note_in_flight(self, in_flight: set[int], seq: Sequence, num_new: int) -> None:
        """Record the hashes of the prompt blocks that this prefill chunk completes."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or num_new == 1:
            return
        end = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
        first = seq.num_computed_tokens // bm.block_size
        in_flight.update(bm.full_block_hashes(seq, end)[first:])

    def _add_to_batch(self, batch: ScheduledBatch, seq: Sequence, num_new: int) -> None:
        item = ScheduledSeq(seq, num_new)
        if num_new == 1:
            batch.decodes.append(item)
        else:
            batch.prefills.append(item)
        if not item.completes_prefill:
            self.counters.chunked_prefills += 1

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            batch.swap_out.extend(bm.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            self.counters.preemptions_swap += 1
            return
        bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions_recompute += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and release its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.drop_swapped(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.matcher = None  # a grammar's state is of no use once the sequence ends

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """Insert a forked sample right after its parent among the running sequences."""
        self.block_manager.fork(parent, child)
        self.running.insert(self.running.index(parent) + 1, child)

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled: list[list[int]],
        logprobs: list[list[TokenLogprob] | None] | None = None,
    ) -> list[Sequence]:
        """Account for the computed tokens, append the sampled ones (and their logprobs, when
        given, forking n > 1 requests after their prefill), finish sequences that hit a
        token-level stop condition and release their blocks. Returns the sequences that
        received tokens."""
        updated: list[Sequence] = []
        if logprobs is None:
            logprobs = [None] * len(sampled)
        for item, token_ids, token_logprobs in zip(batch.seqs, sampled, logprobs):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit_full_blocks(seq)
            if not token_ids:
                continue
            family = [seq]
            if seq.pending_fork:
                seq.pending_fork = False
                children = [seq.fork(self.next_seq_id(), i) for i in range(1, len(token_ids))]
                seq.generators = seq.generators[:1]
                for child in reversed(children):
                    self.add_fork(seq, child)
                family += children
            for i, (member, token_id) in enumerate(zip(family, token_ids)):
                member.token_ids.append(token_id)
                if token_logprobs is not None:
                    member.output_logprobs.append(token_logprobs[i])
                self._check_stop(member)
                updated.append(member)
                if (
                    self.restart_past is not None
                    and member.finish_reason is None
                    and not member.cache_salt
                    and member.num_tokens > self.restart_past
                ):
                    self._restart_long(member)
        return updated

    def _restart_long(self, seq: Sequence) -> None:
        """Recompute a sequence that grew past `restart_past`: its blocks are released and it
        waits first in line, to be prefilled whole with the long-context factors (salted
        apart in the prefix cache from the short ones)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.block_hashes = []
        seq.cache_salt = 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.counters.long_context_restarts += 1

    def _check_stop(self, seq: Sequence) -> None:
        token_id = seq.token_ids[-1]
        params = seq.sampling_params
        grammar = advance(seq.matcher, token_id) if seq.matcher is not None else None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif token_id in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token_id
        elif grammar == "stop":  # the grammar is complete: nothing but EOS could follow
            seq.finish_reason = FinishReason.STOP
        elif grammar == "error":  # the mask forbids this; a matcher bug must not run on
            seq.finish_reason, seq.stop_reason = FinishReason.ERROR, "grammar"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            self.finish(seq)
