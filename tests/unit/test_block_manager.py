"""The block manager as a hypothesis state machine, with a model of the cache's contents.

Twice: with one KV cache group (a uniform model), and with the groups of a hybrid model (a
full-attention table and two sliding-window tables over one pool), where window blocks go
back to the pool as sequences advance and prefix hits must hold in every group.

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

from pagecli.engine.block_manager import NULL_BLOCK, BlockManager
from pagecli.engine.kv_groups import KVGroup, KVGroups, plan_kv_groups
from pagecli.engine.sequence import Sequence
from pagecli.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_SWAP_BLOCKS = 10
# A small alphabet and shared stems make prefix hits common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5]]


WINDOW = 6  # tokens: a window group reads the blocks of the last 6 positions
HYBRID = KVGroups((KVGroup(None, (0,)), KVGroup(WINDOW, (1,)), KVGroup(WINDOW, (2,))), slots=1)


class BlockManagerMachine(RuleBasedStateMachine):
    GROUPS: KVGroups | None = None  # None: one group
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            self.NUM_BLOCKS, BLOCK_SIZE, True, "test", NUM_SWAP_BLOCKS, kv_groups=self.GROUPS
        )
        self.live: list[Sequence] = []  # hold device blocks
        self.swapped: list[Sequence] = []  # hold host blocks
        self.ids = itertools.count()
        self.content: dict[int, list[int | None]] = {}  # device block -> token per slot
        self.host: dict[int, list[int | None]] = {}

    # ---- helpers -------------------------------------------------------------------------

    def _apply_copies(self) -> None:
        for src, dst in self.bm.take_pending_copies():
            self.content[dst] = list(self.content[src])

    def _write(self, seq: Sequence, pos: int, token: int) -> None:
        """K/V of one position (here: its token id) into every group's block for it."""
        for table in seq.block_tables:
            block = table[pos // BLOCK_SIZE]
            assert block != NULL_BLOCK, f"seq {seq.seq_id} writes position {pos} into no block"
            self.content.setdefault(block, [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = token

    def _compute(self, seq: Sequence, num_new: int) -> None:
        """Write K/V (here: the token ids) for the next `num_new` tokens."""
        self._apply_copies()
        start = seq.num_computed_tokens
        for pos in range(start, start + num_new):
            self._write(seq, pos, seq.token_ids[pos])
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
            self._check_window_held(seq)
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
            self._write(seq, start + j, t)
        seq.token_ids.extend(drafts[:accepted])
        seq.num_computed_tokens = start + 1 + accepted
        self.bm.commit_full_blocks(seq)  # hashes of accepted tokens only
        self.bm.trim(seq)
        for table in seq.block_tables:
            assert len(table) == self.bm.blocks_needed(seq.num_tokens)

    # ---- checks --------------------------------------------------------------------------

    def _check_window_held(self, seq: Sequence) -> None:
        """Right after a decode's allocation a window group holds only the blocks of the
        positions its query reads: at most ceil(window / block) + 1, none before them."""
        for group, table in zip(self.bm.groups, seq.block_tables):
            if group.window is None:
                continue
            first = group.first_needed_block(seq.num_computed_tokens, BLOCK_SIZE)
            assert all(b == NULL_BLOCK for b in table[:first]), table
            held = sum(b != NULL_BLOCK for b in table)
            assert held <= -(-group.window // BLOCK_SIZE) + 1, table

    def _check_reads(self, seq: Sequence) -> None:
        """Every position the sequence's next query reads holds its token, in every group
        (a window group: the last WINDOW - 1 computed positions)."""
        for group, table in zip(self.bm.groups, seq.block_tables):
            first = 0 if group.window is None else seq.num_computed_tokens - group.window + 1
            for pos in range(max(0, first), seq.num_computed_tokens):
                block = table[pos // BLOCK_SIZE]
                assert (
                    block != NULL_BLOCK
                    and self.content[block][pos % BLOCK_SIZE] == (seq.token_ids[pos])
                ), f"seq {seq.seq_id} reads a wrong token at position {pos} ({group.kind})"

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


class HybridBlockManagerMachine(BlockManagerMachine):
    GROUPS = HYBRID
    NUM_BLOCKS = 3 * NUM_BLOCKS  # three tables per sequence


TestHybridBlockManager = HybridBlockManagerMachine.TestCase
TestHybridBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


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


class RecurrentBlockManagerMachine(BlockManagerMachine):
    """A model with recurrent layers beside a window and full attention: every sequence also
    holds a state slot, and a fake state (the tuple of tokens it has consumed) must always be
    exactly the sequence's computed tokens: zeroed when it starts, restored from a snapshot
    on a prefix hit, copied on a fork, moved to a host slot and back on a swap, saved at
    snapshot boundaries (every 2 blocks, 5 kept, least recently used evicted)."""

    GROUPS = HYBRID
    NUM_BLOCKS = 3 * NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            self.NUM_BLOCKS, BLOCK_SIZE, True, "test", NUM_SWAP_BLOCKS, kv_groups=HYBRID,
            num_state_slots=64, num_snapshots=5, snapshot_stride=2, num_swap_states=3,
        )  # fmt: skip
        self.states: dict[int, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.host_states: dict[int, tuple[int, ...]] = {}

    def _apply_state_swaps(self) -> None:
        out, into = self.bm.take_pending_state_swaps()
        for slot, host in out:
            self.host_states[host] = self.states[slot]
        for host, slot in into:
            self.states[slot] = self.host_states[host]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        super().swap_out(data)
        self._apply_state_swaps()

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        super().swap_in(data)
        self._apply_state_swaps()

    def _compute(self, seq: Sequence, num_new: int) -> None:
        """As steps would: in pieces that end at snapshot boundaries (chunked prefills)."""
        step = self.bm.snapshot_stride * BLOCK_SIZE
        while num_new:
            piece = min(num_new, step - seq.num_computed_tokens % step)
            self._compute_piece(seq, piece)
            num_new -= piece

    def _compute_piece(self, seq: Sequence, num_new: int) -> None:
        bm = self.bm
        start = seq.num_computed_tokens
        bm.plan_snapshot(seq, start + num_new)
        restores, saves = bm.take_pending_snapshots()
        if start == 0:
            self.states[seq.state_slot] = ()  # a new sequence's zeroed state
        for snapshot, slot in restores:
            self.states[slot] = self.snapshots[snapshot]
        assert self.states[seq.state_slot] == tuple(seq.token_ids[:start]), "a wrong state"
        super()._compute(seq, num_new)
        self.states[seq.state_slot] += tuple(seq.token_ids[start : start + num_new])
        for slot, snapshot in saves:
            self.snapshots[snapshot] = self.states[slot]
        bm.commit_snapshots()

    @precondition(lambda self: self.live and self.bm.num_free_state_slots)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = parent.fork(next(self.ids), 1)
        self.bm.fork(parent, child)
        for src, dst in self.bm.take_pending_state_copies():
            self.states[dst] = self.states[src]
        self.live.append(child)

    @precondition(lambda self: False)  # recurrent layers take no drafts
    @rule()
    def spec_step(self):
        pass

    @invariant()
    def states_hold_the_computed_tokens(self):
        for seq in self.live:
            assert self.states[seq.state_slot] == tuple(seq.token_ids[: seq.num_computed_tokens])


TestRecurrentBlockManager = RecurrentBlockManagerMachine.TestCase
TestRecurrentBlockManager.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)


def test_the_recurrent_machine_reaches_snapshot_hits():
    """A scripted run: a snapshot saved at a boundary serves a later sequence's hit."""
    machine = RecurrentBlockManagerMachine()
    machine.admit(stem=STEMS[0], tail=[1, 2, 3, 4, 5, 6, 7, 8])  # 17 tokens: boundaries 8, 16
    assert machine.bm.num_snapshots_held == 2
    machine.free(data=_first())
    machine.admit(stem=STEMS[0], tail=[1, 2, 3, 4, 5, 6, 7, 8, 9, 9])
    assert machine.bm.counters.prefix_hit_tokens == 16
    machine.consistent()
    machine.states_hold_the_computed_tokens()
    machine.teardown()


class _first:
    """A stand-in for hypothesis' data: draws the first choice."""

    def draw(self, strategy):
        return strategy.example() if not hasattr(strategy, "elements") else strategy.elements[0]


def _hybrid_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), list(tokens), len(tokens), SamplingParams(), 64)


def test_window_groups_free_blocks_and_a_hit_needs_only_the_window():
    """A long sequence's window groups hold only their window; after it ends, a sequence with
    the same prefix hits it whole although the window groups kept only the blocks near its
    end (the rest were given back, and some of those were taken by other sequences)."""
    bm = BlockManager(64, BLOCK_SIZE, True, "test", kv_groups=HYBRID)
    tokens = list(range(1, 41))  # 10 blocks
    a = _hybrid_seq(0, tokens)
    assert bm.match_prefix(a) == 0
    for _ in range(0, 40, 8):  # chunked prefill, 8 tokens a chunk
        assert bm.allocate_slots(a, 8)
        a.num_computed_tokens += 8
        bm.commit_full_blocks(a)
    full, w1, w2 = a.block_tables
    assert NULL_BLOCK not in full and len(full) == 10
    first = HYBRID.groups[1].first_needed_block(32, BLOCK_SIZE)  # the last chunk's start
    assert first == 6 and w1[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in w1[first:]
    assert bm.counters.window_freed == 2 * first
    assert bm.used_blocks_by_group() == [10, 4, 4]
    bm.check_invariants([a])
    bm.free(a)
    # another sequence takes (and so evicts) some of the window blocks given back early
    filler = _hybrid_seq(1, list(range(100, 148)))
    assert bm.match_prefix(filler) == 0 and bm.allocate_slots(filler, 48)
    bm.free(filler)
    b = _hybrid_seq(2, tokens + [7, 7, 7])
    assert bm.match_prefix(b) == 40  # every group serves it: the windows need blocks 8, 9
    assert b.block_tables[1][:8] == [NULL_BLOCK] * 8
    bm.check_invariants([b])
    assert bm.allocate_slots(b, 3)
    bm.free(b)
    bm.check_invariants([])


def test_a_missing_window_block_shortens_the_hit_to_what_every_group_serves():
    """Full attention could serve 9 blocks, but one window group lost block 7: the hit is the
    longest prefix whose window blocks that group still has (7 blocks: it reads 5 and 6)."""
    bm = BlockManager(64, BLOCK_SIZE, True, "test", kv_groups=HYBRID)
    tokens = list(range(1, 41))
    a = _hybrid_seq(0, tokens)
    bm.match_prefix(a)
    for _ in range(40):  # one token at a time: every window block is kept as cached-free
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        bm.commit_full_blocks(a)
    bm.free(a)
    # forget group 2's block 7 (as an eviction would)
    h7 = a.block_hashes[7]
    block_id = bm._hash_to_block.pop((2, h7))
    block = bm.blocks[block_id]
    block.hash = block.parent_hash = block.token_ids = None
    del bm._cached_free[block_id]
    bm._free_ids.append(block_id)
    bm.check_invariants([])
    b = _hybrid_seq(1, tokens)  # 39 tokens past which one is left to compute: 9 full blocks
    assert bm.match_prefix(b) == 7 * BLOCK_SIZE
    first = HYBRID.groups[2].first_needed_block(28, BLOCK_SIZE)
    assert first == 5 and b.block_tables[2][first:] != [] and NULL_BLOCK not in b.block_tables[0]
    bm.check_invariants([b])
    bm.free(b)


@pytest.mark.parametrize(
    ("windows", "slots", "tables"),
    [
        ([None] * 4, 4, 1),  # uniform: one group of every layer
        ([512] * 6, 6, 1),  # every layer windowed (Mistral 7B v0.1): one window group
        ([512] * 5 + [None], 1, 6),  # Gemma 3 (one period): each layer its own table
        (([512] * 5 + [None]) * 4 + [512, 512], 4, 7),  # Gemma 3 1B: 4 full, 22 window
        ([128, None] * 12, 12, 2),  # gpt-oss-20b: alternating
        ([4096, None] * 2, 4, 1),  # a window past max_model_len frees nothing: full
    ],
)
def test_plan_kv_groups(windows, slots, tables):
    plan = plan_kv_groups(windows, max_model_len=4096)
    assert plan.slots == slots and plan.num_groups == tables
    placement = plan.placement(len(windows))
    assert sorted(placement) == sorted(set(placement))  # no two layers share a (group, slot)
    for layer, (g, slot) in enumerate(placement):
        group = plan.groups[g]
        assert group.layers[slot] == layer and slot < plan.slots
        window = windows[layer]
        assert group.window == (None if window is None or window >= 4096 else window)
    assert plan_kv_groups(windows, 4096, hybrid=False).num_groups == 1


def test_gemma3_1b_shape_at_32k_tokens_holds_under_a_quarter_of_full_kv():
    """Gemma 3 1B's layers (26: a full-attention layer after every five of window 512, as
    transformers' config lays them out), a 32k-token prompt prefilled in chunks of 2048
    tokens (max_num_batched_tokens' default), then 64 decodes: the most KV it ever holds, in
    layer-blocks (pages x layers a page holds) and in bytes, against full KV for every layer."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(num_hidden_layers=26, sliding_window=512)
    windows = [512 if t == "sliding_attention" else None for t in config.layer_types]
    assert windows.count(None) == 4
    bs, prompt, chunk, decodes = 16, 32768, 2048, 64
    plan = plan_kv_groups(windows, max_model_len=prompt + decodes)
    bm = BlockManager(10**6, bs, True, "gemma3-1b", kv_groups=plan)
    seq = _hybrid_seq(0, [i % 50000 for i in range(prompt)])
    bm.match_prefix(seq)
    peak = 0
    while seq.num_computed_tokens < prompt:
        n = min(chunk, prompt - seq.num_computed_tokens)
        assert bm.allocate_slots(seq, n)
        peak = max(peak, bm.num_used_blocks)
        seq.num_computed_tokens += n
        bm.commit_full_blocks(seq)
    for token in range(decodes):
        seq.token_ids.append(token)
        assert bm.allocate_slots(seq, 1)
        peak = max(peak, bm.num_used_blocks)
        seq.num_computed_tokens += 1
    full_layer_blocks = len(windows) * bm.blocks_needed(prompt + decodes)
    held = peak * plan.slots  # layer-blocks, including the unused slots of partial groups
    assert held <= 0.25 * full_layer_blocks, (held, full_layer_blocks)
    # bytes: a page of `slots` layers against a block of every layer (head_dim 256, 1 KV head)
    page_bytes = 2 * plan.slots * bs * config.num_key_value_heads * config.head_dim * 4
    full_bytes = 2 * len(windows) * bs * config.num_key_value_heads * config.head_dim * 4
    ratio = peak * page_bytes / (bm.blocks_needed(prompt + decodes) * full_bytes)
    assert ratio <= 0.25
    # after the prefill, the windows hold only their last 512 tokens' blocks
    used = bm.used_blocks_by_group()
    assert used[0] == bm.blocks_needed(prompt + decodes)
    assert all(u <= 512 // bs + 1 for g, u in zip(plan.groups, used) if g.window)
    bm.check_invariants([seq])
