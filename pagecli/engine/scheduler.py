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
from typing import TYPE_CHECKING

from pagecli.config import EngineConfig
from pagecli.engine.block_manager import BlockManager
from pagecli.engine.sequence import FinishReason, Sequence, SequenceStatus
from pagecli.engine.structured import advance
from pagecli.outputs import TokenLogprob

if TYPE_CHECKING:
    import torch

# A waiting sequence whose prompt continues with at least this many blocks that another
# sequence computes in this very step waits one step and finds them cached; fewer are
# cheaper to recompute than to wait for.
MIN_BLOCKS_TO_WAIT_FOR = 2


@dataclass
class ScheduledSeq:
    """One sequence's part of a step: `num_new_tokens` tokens to compute, the last of which
    are `draft_token_ids` (speculative decoding: a decode of 1 + k tokens whose k + 1 rows
    are all sampled, each checked against the draft before it). `draft_probs`: [k, V], the
    distributions a draft model drew the drafts from, where the target accepts them by
    rejection sampling (engine/spec_decode/verify.py)."""

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None

    @property
    def completes_prefill(self) -> bool:
        """True when this chunk brings the sequence up to date, so its last logits are sampled."""
        num_real = self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.num_computed_tokens + num_real == self.seq.num_tokens

    @property
    def num_rows(self) -> int:
        """Logits rows this item samples: 1 + k for a decode with k drafts, 1 for a decode
        or a prefill that completes its prompt, 0 for a chunk that does not."""
        return 1 + len(self.draft_token_ids) if self.completes_prefill else 0


@dataclass
class SampledTokens:
    """What one step gave one scheduled sequence: the ids drawn (empty for a prefill chunk
    that does not finish its prompt; n ids for a request's first tokens with n > 1; the
    accepted drafts then one more id for a speculative decode), one TokenLogprob per id
    where the request asked for them, and how many of its drafts were accepted."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    num_accepted: int = 0


@dataclass
class ScheduledBatch:
    """One step's work. Decodes (one new token) come first in the flattened batch."""

    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # forks' state slots
    # recurrent states: (snapshot, slot) restored before the forward (prefix hits), (slot,
    # snapshot) saved after it (sequences reaching a snapshot boundary)
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (slot, host slot)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, slot)
    snapshot_saves: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.decodes) + sum(
            s.num_new_tokens for s in self.prefills
        )

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
    # speculative decoding: decodes that carried drafts, the drafts, those accepted, and
    # those accepted at each draft position (vLLM's spec_decode_* counters)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


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
            drafts = self._drafts_to_check(seq, budget)
            # drafts take free blocks only where every running sequence keeps one for its
            # next token: they never cost a preemption
            spare = bm.num_free_blocks - len(self.running)
            if (
                drafts
                and bm.slots_cost(seq, 1 + len(drafts)) <= spare
                and bm.allocate_slots(seq, 1 + len(drafts))
            ):
                self._add_to_batch(batch, seq, 1 + len(drafts), drafts)
                budget -= 1 + len(drafts)
                i += 1
                continue
            num_new = self._chunk(seq, budget)
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
            num_new = self._chunk(seq, budget)
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
            num_new = self._chunk(seq, budget)
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
        batch.state_copies = bm.take_pending_state_copies()
        batch.state_restores, batch.snapshot_saves = bm.take_pending_snapshots()
        batch.state_swap_out, batch.state_swap_in = bm.take_pending_state_swaps()
        self.counters.steps += 1
        return batch

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens the sequence computes this step: all it has left, within the budget; a
        model whose recurrent states are snapshotted stops a prefill chunk at the last
        snapshot boundary before the prompt's end (saved there: the state a longer prompt
        sharing it, as a chat's next turn, resumes from), and goes on next step."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        bm = self.block_manager
        if bm.num_snapshots and num_new > 1:
            step = bm.snapshot_stride * bm.block_size
            start = seq.num_computed_tokens
            last = (seq.num_tokens - 1) // step * step
            if start < last < start + num_new:
                num_new = last - start
        return num_new

    def _drafts_to_check(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a decoding sequence carries into this step, cut to what it may still
        emit (each accepted draft and the token after them are outputs: max_tokens and
        max_model_len bound them), to the token budget, and short of a LongRoPE model's
        restart point; [] for any other sequence. Drafts never cost a preemption: the caller
        checks them only where their blocks are free."""
        drafts = seq.draft_token_ids
        seq.draft_token_ids = []
        if not drafts or seq.num_uncomputed_tokens != 1:
            return []
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        room = min(room - 1, budget - 1)
        if self.restart_past is not None and seq.num_tokens <= self.restart_past:
            room = min(room, self.restart_past - seq.num_tokens)
        return drafts[: max(room, 0)]

    def _note_in_flight(self, in_flight: set[int], seq: Sequence, num_new: int) -> None:
        """Record the hashes of the prompt blocks that this prefill chunk completes."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or num_new == 1:
            return
        end = min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
        first = seq.num_computed_tokens // bm.block_size
        in_flight.update(bm.full_block_hashes(seq, end)[first:])

    def _add_to_batch(
        self, batch: ScheduledBatch, seq: Sequence, num_new: int, drafts: list[int] | None = None
    ) -> None:
        item = ScheduledSeq(seq, num_new, drafts or [])
        if not drafts:  # a recurrent model's state, at a snapshot boundary
            self.block_manager.plan_snapshot(seq, seq.num_computed_tokens + num_new)
        if num_new == 1 or drafts:
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
        seq.num_computed_tokens = seq.num_draft_computed = 0
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

    def postprocess(self, batch: ScheduledBatch, samples: list[SampledTokens]) -> list[Sequence]:
        """Account for the computed tokens, append the sampled ones (and their logprobs, when
        given, forking n > 1 requests after their prefill), finish sequences that hit a
        token-level stop condition and release their blocks. A speculative decode keeps the
        K/V of its accepted drafts only: the rest of its slots are rolled back, and blocks
        that hold nothing else are freed. Returns the sequences that received tokens."""
        updated: list[Sequence] = []
        self.block_manager.commit_snapshots()  # the states saved after the forward
        for item, sampled in zip(batch.seqs, samples):
            seq = item.seq
            token_ids = sampled.token_ids
            if item.draft_token_ids:
                self._count_spec(item, sampled.num_accepted)
                # the decoded token and the accepted drafts have their K/V in the cache
                seq.num_computed_tokens += 1 + sampled.num_accepted
            else:
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
                pairs = [(member, [t]) for member, t in zip(family, token_ids)]
            else:
                pairs = [(seq, token_ids)]
            for member, ids in pairs:
                self._append(member, ids, sampled.logprobs, family.index(member))
                updated.append(member)
            if item.draft_token_ids and seq.status is SequenceStatus.RUNNING:
                self.block_manager.trim(seq)  # blocks that held only rejected drafts
        return updated

    def _append(
        self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprob] | None, index: int
    ) -> None:
        """Append a sequence's new tokens one at a time, each checked for a stop: a run of
        accepted drafts ends at the first token that stops it, as decoding token by token
        would."""
        for j, token_id in enumerate(token_ids):
            seq.token_ids.append(token_id)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[index + j])
            self._check_stop(seq)
            if seq.finish_reason is not None:
                return
            if (
                self.restart_past is not None
                and not seq.cache_salt
                and seq.num_tokens > self.restart_past
            ):
                self._restart_long(seq)
                return

    def _count_spec(self, item: ScheduledSeq, num_accepted: int) -> None:
        counters = self.counters
        counters.spec_drafts += 1
        counters.spec_draft_tokens += len(item.draft_token_ids)
        counters.spec_accepted_tokens += num_accepted
        per_position = counters.spec_accepted_per_position
        if len(per_position) < len(item.draft_token_ids):
            per_position.extend([0] * (len(item.draft_token_ids) - len(per_position)))
        for i in range(num_accepted):
            per_position[i] += 1

    def _restart_long(self, seq: Sequence) -> None:
        """Recompute a sequence that grew past `restart_past`: its blocks are released and it
        waits first in line, to be prefilled whole with the long-context factors (salted
        apart in the prefix cache from the short ones)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
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
