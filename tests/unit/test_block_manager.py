"""The block manager as a hypothesis state machine, with a model of the cache's contents.

Random sequences are admitted (with prefix-cache lookups), grow token by token or by a
speculative step (1 + k slots, a <= k drafts accepted, the rest rolled back), fork (n > 1,
copy-on-write), are swapped out and in, and are freed. A fake KV cache records which token
each slot holds: after every step every sequence must read back exactly its own tokens, and
`check_invariants()` must hold. At the end, with every sequence freed, no block is in use.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagecli.engine.block_manager import BlockManager
from pagecli.engine.sequence import Sequence
from pagecli.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_SWAP_BLOCKS = 10
# A small alphabet and shared stems make prefix hits common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, True, "test", NUM_SWAP_BLOCKS)
        self.live: list[Sequence] = []  # hold device blocks
        self.swapped: list[Sequence] = []  # hold host blocks
        self.ids = itertools.count()
        self.content: dict[int, list[int | None]] = {}  # device block -> token per slot
        self.host: dict[int, list[int | None]] = {}

    # ---- helpers -------------------------------------------------------------------------

    def _apply_copies(self) -> None:
        for src, dst in self.bm.take_pending_copies():
            self.content[dst] = list(self.content[src])

    def _compute(self, seq: Sequence, num_new: int) -> None:
        """Write K/V (here: the token ids) for the next `num_new` tokens."""
        self._apply_copies()
        start = seq.num_computed_tokens
        for pos in range(start, start + num_new):
            block = seq.block_table[pos // BLOCK_SIZE]
            self.content.setdefault(block, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = seq.token_ids[
                pos
            ]
        seq.num_computed_tokens += num_new
        self.bm.commit_full_blocks(seq)

    def _drop(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.live.remove(seq)

    # ---- rules ---------------------------------------------------------------------------

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(1, 9), max_size=10))
    def admit(self, stem, tail):
        tokens = stem + tail
        seq = Sequence(next(self.ids), "r", tokens, len(tokens), SamplingParams(), 64)
        hit = self.bm.match_prefix(seq)
        assert hit % BLOCK_SIZE == 0 and hit < len(tokens)
        self._check_reads(seq)  # cached blocks hold exactly this prefix
        if not self.bm.allocate_slots(seq, seq.num_uncomputed_tokens):
            self.bm.free(seq)
            return
        self.live.append(seq)
        self._compute(seq, seq.num_uncomputed_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 9))
    def append(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.token_ids.append(token)
        if self.bm.allocate_slots(seq, 1):
            self._compute(seq, 1)
        else:
            self._drop(seq)  # as a recompute preemption would

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork(next(self.ids), 1)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        self._drop(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.live))
        if not self.bm.can_swap_out(seq):
            return
        self._apply_copies()
        for dev, host in self.bm.swap_out(seq):
            self.host[host] = list(self.content[dev])
        self.live.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        if not self.bm.can_swap_in(seq):
            return
        for host, dev in self.bm.swap_in(seq):
            self.content[dev] = list(self.host[host])
        self.swapped.remove(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(
        data=st.data(),
        token=st.integers(1, 9),
        drafts=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    )
    def spec_step(self, data, token, drafts):
        """A speculative decode: slots for the new token and k drafts, K/V written for all,
        a <= k drafts accepted, the rest rolled back (their trailing blocks freed)."""
        seq = data.draw(st.sampled_from(self.live))
        accepted = data.draw(st.integers(0, len(drafts)))
        seq.token_ids.append(token)
        if not self.bm.allocate_slots(seq, 1 + len(drafts)):
            seq.token_ids.pop()  # nothing was taken: the step runs without drafts
            return
        self._apply_copies()
        start = seq.num_computed_tokens
        for j, t in enumerate([token, *drafts]):
            block = seq.block_table[(start + j) // BLOCK_SIZE]
            self.content.setdefault(block, [None] * BLOCK_SIZE)[(start + j) % BLOCK_SIZE] = t
        seq.token_ids.extend(drafts[:accepted])
        seq.num_computed_tokens = start + 1 + accepted
        self.bm.commit_full_blocks(seq)  # hashes of accepted tokens only
        self.bm.trim(seq)
        assert len(seq.block_table) == self.bm.blocks_needed(seq.num_tokens)

    # ---- checks --------------------------------------------------------------------------

    def _check_reads(self, seq: Sequence) -> None:
        for pos in range(seq.num_computed_tokens):
            block = seq.block_table[pos // BLOCK_SIZE]
            assert self.content[block][pos % BLOCK_SIZE] == seq.token_ids[pos], (
                f"seq {seq.seq_id} reads a wrong token at position {pos}"
            )

    @invariant()
    def consistent(self):
        self.bm.check_invariants(self.live)
        self._apply_copies()
        for seq in self.live:
            self._check_reads(seq)

    def teardown(self):
        for seq in list(self.live):
            self._drop(seq)
        for seq in self.swapped:
            self.bm.drop_swapped(seq)
        self.bm.check_invariants([])
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_swapped_blocks == 0


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_machine_reaches_hits_cow_evictions_and_swaps():
    """The interesting transitions do happen in a plain scripted run."""
    bm = BlockManager(6, BLOCK_SIZE, True, "test", 4)
    a = Sequence(0, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 9, SamplingParams(), 8)
    assert bm.match_prefix(a) == 0 and bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.commit_full_blocks(a)
    bm.free(a)
    assert bm.num_cached_free_blocks == 2
    b = Sequence(1, "b", [1, 2, 3, 4, 5, 6, 7, 8, 1], 9, SamplingParams(), 8)
    assert bm.match_prefix(b) == 8  # both full blocks found again
    assert bm.allocate_slots(b, 1)
    b.num_computed_tokens = 9
    c = b.fork(2, 1)
    bm.fork(b, c)
    assert bm.num_shared_blocks == 3  # two prompt blocks and the partly filled last one
    c.token_ids.append(3)
    assert bm.allocate_slots(c, 1)
    assert bm.counters.cow_copies == 1 and bm.take_pending_copies()
    assert bm.swap_out(c) and bm.num_swapped_blocks == 3
    assert bm.swap_in(c)
    bm.free(b)
    bm.free(c)
    bm.check_invariants([])
    # Fill the pool with a new sequence: cached-free blocks are evicted only when needed.
    d = Sequence(3, "d", list(range(20, 44)), 24, SamplingParams(), 8)
    assert bm.match_prefix(d) == 0 and bm.allocate_slots(d, 24)
    assert bm.counters.evictions > 0
    bm.free(d)
    bm.check_invariants([])


@pytest.mark.parametrize("n", [1, 7])
def test_match_prefix_leaves_one_token_to_compute(n):
    bm = BlockManager(8, BLOCK_SIZE, True, "test")
    tokens = list(range(1, 9))  # exactly two blocks
    a = Sequence(0, "a", tokens, 8, SamplingParams(n=n), 8)
    bm.match_prefix(a)
    bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.commit_full_blocks(a)
    bm.free(a)
    b = Sequence(1, "b", tokens, 8, SamplingParams(n=n), 8)
    assert bm.match_prefix(b) == 4  # the last block is recomputed so logits exist


def test_hash_collision_is_a_miss():
    bm = BlockManager(8, BLOCK_SIZE, True, "test")
    a = Sequence(0, "a", [1, 2, 3, 4, 5], 5, SamplingParams(), 8)
    bm.match_prefix(a)
    bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.commit_full_blocks(a)
    # Corrupt the stored tokens: the hash still matches but verification must refuse it.
    bm.blocks[a.block_table[0]].token_ids = (9, 9, 9, 9)
    bm.free(a)
    b = Sequence(1, "b", [1, 2, 3, 4, 5], 5, SamplingParams(), 8)
    assert bm.match_prefix(b) == 0
