"""KV block pool: ref counts, free list, LRU of cached-free blocks, prefix hash table,
copy-on-write and a host-memory swap pool.

A block is in exactly one state:
  free         ref_count 0, no hash                 (in `_free_ids`, or never handed out yet)
  cached-free  ref_count 0, hash still findable     (in `_cached_free`, least recent first)
  in use       ref_count >= 1                       (held by that many block tables)
Only full blocks whose K/V have been computed get a hash. A hash chains the parent block's hash
with the block's token ids (and the model's identity, and the sequence's cache salt), so equal
hashes mean equal prefixes; a hit is still verified against the stored parent hash and token
ids.

A model whose layers differ (sliding windows beside full attention) has several KV cache groups
(engine/kv_groups.py): one pool of pages, one block table per group and sequence. A window
group's blocks wholly before its window go back to the pool as the sequence advances (their
table entries become NULL_BLOCK), a block's hash is findable per group, and a prefix hit is
the longest prefix that every group can serve: full attention needs every block of it, a
window group only the blocks its next query reads.

A model with recurrent layers (Gated DeltaNet) also gives each running sequence a state slot
(its conv window and recurrent state in every such layer), taken with its first blocks and
given back with them; the sample forks of an n > 1 request have theirs kept from admission.
A prefix hit must restore the state as it was at the hit's end: copies of states (snapshots)
are kept at every `snapshot_stride` blocks, keyed by the chained hash of the block that ends
there, least recently used evicted first; a hit ends where a snapshot is (and every KV group
serves it), and its sequence starts from a copy of that snapshot. A swap-out also moves the
state to a host slot (`num_swap_states`; without one it is a recompute).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagecli.engine.kv_groups import KVGroup, KVGroups
from pagecli.engine.sequence import Sequence

NULL_BLOCK = -1  # a window group's table entry for a block it has given back


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    group: int = 0  # the KV cache group whose table it was last handed to


@dataclass
class BlockCounters:
    """Engine-wide counters since start-up (plain numbers, read by EngineStats)."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    evictions: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    window_freed: int = 0  # blocks window groups gave back before their sequence ended
    snapshots_saved: int = 0  # recurrent states copied at a snapshot boundary
    snapshot_evictions: int = 0


class BlockManager:
    """Owns which KV block holds what. Tensors live in the model runner: copies that the
    runner must perform (copy-on-write, swap) are returned or queued in `pending_copies`.
    A copy moves a whole page (every group's slots of it)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        model_key: str = "",
        num_swap_blocks: int = 0,
        kv_groups: KVGroups | None = None,
        num_state_slots: int = 0,
        num_snapshots: int = 0,
        snapshot_stride: int = 0,
        num_swap_states: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_groups = kv_groups or KVGroups((KVGroup(None, (0,)),), 1)
        self.groups: tuple[KVGroup, ...] = self.kv_groups.groups
        self.num_groups = len(self.groups)
        self._root_hash = hash(("pagecli-prefix", model_key))
        # Blocks come into being when first handed out, in id order: ids from len(blocks) up
        # are free and were never used. A pool of millions of small blocks (a small model
        # under a large --kv-cache-memory) starts at once, and the walks over `blocks` (the
        # stats, the invariants) cover only the blocks ever used.
        self.blocks: list[Block] = []
        self._free_ids: deque[int] = deque()  # freed blocks, handed out after the unused
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[tuple[int, int], int] = {}  # (group, hash) -> block
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) device blocks
        self.counters = BlockCounters()
        # Host pool for swapped-out sequences: seq_id -> per group, host block ids in table
        # order (NULL_BLOCK where the device table had none).
        self.num_swap_blocks = num_swap_blocks
        self._free_swap_ids: deque[int] = deque(range(num_swap_blocks))
        self._swapped: dict[int, list[list[int]]] = {}
        # State slots of a model with recurrent layers (0: none), and (src, dst) slot copies
        # for the runner (a fork's state)
        self.num_state_slots = num_state_slots
        self._free_state_slots: deque[int] = deque(range(num_state_slots))
        self.pending_state_copies: list[tuple[int, int]] = []
        # host slots for swapped-out sequences' states: seq_id -> host slot; (device, host)
        # copies out before the step, (host, device) copies in
        self.num_swap_states = num_swap_states if num_state_slots else 0
        self._free_swap_states: deque[int] = deque(range(self.num_swap_states))
        self._swapped_states: dict[int, int] = {}
        self.pending_state_swaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        # State snapshots: chained hash of the block they end at -> snapshot slot (least
        # recently used first), what each slot holds (hash, parent hash, token ids, to verify
        # a hit as blocks are), and the copies for the runner: restores (snapshot -> state
        # slot) before the step's forward, saves (state slot -> snapshot) after it
        self.num_snapshots = num_snapshots if num_state_slots and snapshot_stride else 0
        self.snapshot_stride = snapshot_stride
        self._snapshots: OrderedDict[int, int] = OrderedDict()
        self._snapshot_keys: dict[int, tuple[int, int | None, tuple[int, ...]]] = {}
        self._free_snapshots: deque[int] = deque(range(self.num_snapshots))
        self.pending_state_restores: list[tuple[int, int]] = []
        self.pending_snapshot_saves: list[tuple[int, int]] = []
        # saves planned for this step: findable only once the step has run (commit_snapshots)
        self._planned: list[tuple[int, int, tuple[int, int | None, tuple[int, ...]]]] = []

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached-free)."""
        return self.num_unused_blocks + len(self._free_ids) + len(self._cached_free)

    @property
    def num_unused_blocks(self) -> int:
        """Free blocks that were never handed out (ids from len(blocks) on)."""
        return self.num_blocks - len(self.blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_shared_blocks(self) -> int:
        return sum(1 for b in self.blocks if b.ref_count > 1)

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._free_swap_ids)

    def used_blocks_by_group(self) -> list[int]:
        """Blocks in use, per KV cache group."""
        counts = [0] * self.num_groups
        for block in self.blocks:
            if block.ref_count:
                counts[block.group] += 1
        return counts

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sequence_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once, computed in
        steps of at most `chunk` tokens: every full-attention table holds all its blocks, a
        window table at most those of its window and one step's tokens."""
        n = self.blocks_needed(num_tokens)
        total = 0
        for group in self.groups:
            if group.window is None:
                total += n
            else:
                total += min(n, self.blocks_needed(group.window - 1 + chunk) + 1)
        return total

    def max_sequence_tokens(self, chunk: int, limit: int) -> int:
        """The longest sequence (up to `limit` tokens) whose blocks fit the whole pool."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.sequence_blocks(mid, chunk) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """The sequence's block tables, one per group (made when it first gets blocks)."""
        tables = seq.block_tables
        if len(tables) != self.num_groups:
            if any(tables):
                raise RuntimeError("a sequence holds block tables of another cache layout")
            tables = seq.block_tables = [[] for _ in range(self.num_groups)]
        return tables

    # ---- prefix cache --------------------------------------------------------------------

    def chain_hash(self, parent_hash: int | None, token_ids: tuple[int, ...], salt: int = 0) -> int:
        """A full block's hash: its parent's (the model's root, salted, for the first block)
        chained with its token ids."""
        if parent_hash is None:
            parent_hash = self._root_hash if not salt else hash((self._root_hash, salt))
        return hash((parent_hash, token_ids))

    def _cached(self, group: int, seq: Sequence, hashes: list[int], i: int) -> int | None:
        """The cached block that holds block i of the sequence's tokens for `group`, or None
        (a hash collision is a miss)."""
        block_id = self._hash_to_block.get((group, hashes[i]))
        if block_id is None:
            return None
        block = self.blocks[block_id]
        bs = self.block_size
        parent = hashes[i - 1] if i else None
        if block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs]):
            return None
        return block_id if block.parent_hash == parent else None

    def _group_hit(self, g: int, seq: Sequence, hashes: list[int], limit: int) -> int:
        """The longest hit of at most `limit` blocks that group g can serve: all blocks from
        the first for full attention; the blocks its next query reads for a window."""
        group = self.groups[g]
        if group.window is None:
            n = 0
            while n < limit and self._cached(g, seq, hashes, n) is not None:
                n += 1
            return n
        n = limit
        while n > 0:  # a missing block i rules out every hit that reads it: those past i
            first = group.first_needed_block(n * self.block_size, self.block_size)
            i = n - 1
            while i >= first and self._cached(g, seq, hashes, i) is not None:
                i -= 1
            if i < first:
                return n
            n = i
        return 0

    def _snapshot_at(self, seq: Sequence, hashes: list[int], n: int) -> int | None:
        """The snapshot of the state after the sequence's first n blocks, or None."""
        h = hashes[n - 1]
        slot = self._snapshots.get(h)
        if slot is None:
            return None
        bs = self.block_size
        parent = hashes[n - 2] if n > 1 else None
        if self._snapshot_keys[slot] != (h, parent, tuple(seq.token_ids[(n - 1) * bs : n * bs])):
            return None  # a hash collision: a miss
        return slot

    def _snapshot_hit(self, seq: Sequence, hashes: list[int], limit: int) -> int:
        """The longest hit of at most `limit` blocks that ends at a state snapshot."""
        stride = self.snapshot_stride
        for n in range(limit - limit % stride, 0, -stride):
            if self._snapshot_at(seq, hashes, n) is not None:
                return n
        return 0

    def plan_snapshot(self, seq: Sequence, end: int) -> None:
        """A step brings the sequence's computed tokens to `end`: when that is a snapshot
        boundary not yet kept, save its state there after the step (a free snapshot slot,
        else the least recently used one)."""
        bs = self.block_size
        if not self.num_snapshots or end % (self.snapshot_stride * bs) or end == 0:
            return
        hashes = self.full_block_hashes(seq, end)
        h = hashes[-1]
        if h in self._snapshots:
            self._snapshots.move_to_end(h)
            return
        if any(planned == h for planned, _, _ in self._planned):
            return
        if self._free_snapshots:
            slot = self._free_snapshots.popleft()
        elif self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
            del self._snapshot_keys[slot]
            self.counters.snapshot_evictions += 1
        else:
            return  # every slot is being saved into this step
        parent = hashes[-2] if len(hashes) > 1 else None
        self._planned.append((h, slot, (h, parent, tuple(seq.token_ids[end - bs : end]))))
        self.pending_snapshot_saves.append((seq.state_slot, slot))
        self.counters.snapshots_saved += 1

    def commit_snapshots(self) -> None:
        """The step ran: its saved snapshots become findable."""
        for h, slot, key in self._planned:
            self._snapshots[h] = slot
            self._snapshot_keys[slot] = key
        self._planned = []

    def take_pending_snapshots(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(restores, saves) for the runner: (snapshot, slot) before the forward, (slot,
        snapshot) after it."""
        restores, saves = self.pending_state_restores, self.pending_snapshot_saves
        self.pending_state_restores, self.pending_snapshot_saves = [], []
        return restores, saves

    @property
    def num_snapshots_held(self) -> int:
        return len(self._snapshots)

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the longest run of cached blocks of its tokens that
        every group can serve (a fixed point: a window group's shorter hit can rule out
        another's).

        At least one token is always left to compute so that the model produces logits.
        Returns the number of tokens found; `seq.num_computed_tokens` is set to it.
        """
        tables = self._tables(seq)
        if any(tables) or seq.num_computed_tokens:
            raise RuntimeError("match_prefix needs a sequence that holds no blocks")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        self.counters.prefix_query_tokens += seq.num_tokens
        if self.num_state_slots and not self.num_snapshots:
            return 0  # no state snapshots: the state must see every token
        hashes = self.full_block_hashes(seq, seq.num_tokens - 1)
        n = len(hashes)
        settled = False
        while not settled:
            settled = True
            for g in range(self.num_groups):
                hit = self._group_hit(g, seq, hashes, n)
                if hit < n:
                    n, settled = hit, False
            if self.num_state_slots:
                hit = self._snapshot_hit(seq, hashes, n)
                if hit < n:
                    n, settled = hit, False
        if n and self.num_state_slots:  # restored into its state slot once it has one
            seq.restore_snapshot = self._snapshots[hashes[n - 1]]
            self._snapshots.move_to_end(hashes[n - 1])
        for g, table in enumerate(tables):
            first = self.groups[g].first_needed_block(n * bs, bs)
            table.extend([NULL_BLOCK] * first)
            for i in range(first, n):
                block_id = self._cached(g, seq, hashes, i)
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del self._cached_free[block_id]
                block.ref_count += 1
                table.append(block_id)
        # Hashes kept from an earlier life (preemption) past the hit are recomputed on commit.
        seq.block_hashes = hashes[:n]
        num_hit = n * bs
        seq.num_computed_tokens = num_hit
        self.counters.prefix_hit_tokens += num_hit
        return num_hit

    def full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Chained hashes of the full blocks among the first `num_tokens` tokens (reusing
        those the sequence already knows)."""
        bs = self.block_size
        hashes = list(seq.block_hashes[: num_tokens // bs])
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[i - 1] if i else None
            ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(self.chain_hash(parent, ids, seq.cache_salt))
        return hashes

    def num_in_flight_blocks(self, seq: Sequence, in_flight: set[int]) -> int:
        """How many full blocks of the sequence, right after those the prefix cache holds (in
        the first group), are being computed in this step (by other sequences)."""
        if not self.enable_prefix_caching or not in_flight:
            return 0
        count = 0
        for h in self.full_block_hashes(seq, seq.num_tokens - 1):
            if (0, h) in self._hash_to_block and not count:
                continue
            if h not in in_flight:
                break
            count += 1
        return count

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's full, computed blocks findable by hash, in every group."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        tables = self._tables(seq)
        num_full = min(seq.num_computed_tokens // bs, len(tables[0]))
        start = len(hashes)
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else None
            ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(self.chain_hash(parent, ids, seq.cache_salt))
        for g, table in enumerate(tables):
            for i in range(start, num_full):
                block_id = table[i]
                if block_id == NULL_BLOCK:
                    continue
                block = self.blocks[block_id]
                h = hashes[i]
                if block.hash is None and (g, h) not in self._hash_to_block:
                    parent = hashes[i - 1] if i else None
                    ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    self._register(block, g, h, parent, ids)
                # else: the same prefix is already cached in another block; this one stays
                # private

    def _register(
        self, block: Block, group: int, h: int, parent: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """Make a full, computed block findable by its chained hash in its group."""
        block.hash, block.parent_hash, block.token_ids = h, parent, token_ids
        block.group = group
        self._hash_to_block[(group, h)] = block.block_id

    @property
    def cached_free_ids(self) -> set[int]:
        """Blocks no sequence holds whose prefix hash is still findable."""
        return set(self._cached_free)

    # ---- allocation ----------------------------------------------------------------------

    def _take_block(self, group: int) -> int:
        if len(self.blocks) < self.num_blocks:  # the unused first, in id order
            block_id = len(self.blocks)
            self.blocks.append(Block(block_id))
        elif self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            del self._hash_to_block[(block.group, block.hash)]
            block.hash = block.parent_hash = block.token_ids = None
            self.counters.evictions += 1
        block = self.blocks[block_id]
        block.ref_count = 1
        block.group = group
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._cached_free[block_id] = None  # most recently used end
            else:
                self._free_ids.append(block_id)

    def _outside_window(self, seq: Sequence) -> list[tuple[list[int], int]]:
        """(table, index) of the blocks the sequence still holds that its window groups no
        longer read: wholly before the window of its next query."""
        found = []
        for group, table in zip(self.groups, self._tables(seq)):
            if group.window is None:
                continue
            first = group.first_needed_block(seq.num_computed_tokens, self.block_size)
            found += [(table, i) for i in range(min(first, len(table))) if table[i] != NULL_BLOCK]
        return found

    def release_outside_window(self, seq: Sequence) -> int:
        """Give back the blocks the sequence's window groups no longer read; how many."""
        found = self._outside_window(seq)
        for table, i in found:
            self._release(table[i])
            table[i] = NULL_BLOCK
        self.counters.window_freed += len(found)
        return len(found)

    def slots_cost(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks that `allocate_slots(seq, num_new_tokens)` would take, less those its
        window groups would give back first (held by this sequence alone)."""
        bs = self.block_size
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        idx = seq.num_computed_tokens // bs
        cost = 0
        for group, table in zip(self.groups, self._tables(seq)):
            first = group.first_needed_block(seq.num_computed_tokens, bs)
            cost += max(0, needed - max(len(table), first))
            if self._needs_cow(table, idx):
                cost += 1
        returned = sum(
            1 for table, i in self._outside_window(seq) if self.blocks[table[i]].ref_count == 1
        )
        return cost - returned

    def _needs_cow(self, table: list[int], idx: int) -> bool:
        return (
            idx < len(table) and table[idx] != NULL_BLOCK and self.blocks[table[idx]].ref_count > 1
        )

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens` K/V entries of `seq`; False (and nothing
        taken) when there are not enough blocks. Window groups first give back the blocks
        they no longer read. A shared block about to be written is copied first
        (copy-on-write)."""
        if self.slots_cost(seq, num_new_tokens) > self.num_free_blocks:
            return False
        if self.num_state_slots and seq.state_slot is None:
            if self._state_slots_wanted(seq) > len(self._free_state_slots):  # one per sample
                return False
            self._take_state_slots(seq)
            if seq.restore_snapshot is not None:  # a prefix hit: its state at the hit
                self.pending_state_restores.append((seq.restore_snapshot, seq.state_slot))
                seq.restore_snapshot = None
        self.release_outside_window(seq)
        bs = self.block_size
        idx = seq.num_computed_tokens // bs
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        for g, table in enumerate(self._tables(seq)):
            if self._needs_cow(table, idx):
                src = table[idx]
                dst = self._take_block(g)
                self._release(src)
                table[idx] = dst
                self.pending_copies.append((src, dst))
                self.counters.cow_copies += 1
            first = self.groups[g].first_needed_block(seq.num_computed_tokens, bs)
            while len(table) < needed:
                table.append(NULL_BLOCK if len(table) < first else self._take_block(g))
        return True

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past those the sequence's tokens need (speculative decoding:
        blocks that held only rejected drafts' K/V), last first."""
        needed = self.blocks_needed(seq.num_tokens)
        for table in self._tables(seq):
            while len(table) > needed:
                block_id = table.pop()
                if block_id != NULL_BLOCK:
                    self._release(block_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (prompt blocks, a partly filled last
        block included); whoever writes a shared block first copies it."""
        child.block_tables = [list(table) for table in self._tables(parent)]
        for table in child.block_tables:
            for block_id in table:
                if block_id != NULL_BLOCK:
                    self.blocks[block_id].ref_count += 1
        if self.num_state_slots:  # the parent's state, copied into a kept slot
            if parent.reserved_state_slots:
                child.state_slot = parent.reserved_state_slots.pop()
            elif self._free_state_slots:
                child.state_slot = self._free_state_slots.popleft()
            else:
                raise RuntimeError("no state slot for a forked sample")
            self.pending_state_copies.append((parent.state_slot, child.state_slot))

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks. Tail blocks are released first so that
        they are evicted before the prefix blocks that others are more likely to share."""
        tables = self._tables(seq)
        for i in reversed(range(len(tables[0]))):
            for table in tables:
                if table[i] != NULL_BLOCK:
                    self._release(table[i])
        seq.block_tables = [[] for _ in range(self.num_groups)]
        if seq.state_slot is not None:
            self._free_state_slots.append(seq.state_slot)
            self._free_state_slots.extend(seq.reserved_state_slots)
            seq.state_slot, seq.reserved_state_slots = None, []
        seq.restore_snapshot = None

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_state_copies = self.pending_state_copies, []
        return copies

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_state_slots)

    # ---- swap ----------------------------------------------------------------------------

    @staticmethod
    def _held(tables: list[list[int]]) -> int:
        return sum(1 for table in tables for b in table if b != NULL_BLOCK)

    def can_swap_out(self, seq: Sequence) -> bool:
        if self.num_state_slots and not self._free_swap_states:
            return False  # no host slot for its state: the scheduler recomputes instead
        return self._held(self._tables(seq)) <= len(self._free_swap_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the host pool. Returns (device, host) copies to do
        before the device blocks are reused."""
        copies, host_tables = [], []
        for table in self._tables(seq):
            host = []
            for block_id in table:
                if block_id == NULL_BLOCK:
                    host.append(NULL_BLOCK)
                    continue
                host.append(self._free_swap_ids.popleft())
                copies.append((block_id, host[-1]))
            host_tables.append(host)
        self._swapped[seq.seq_id] = host_tables
        self.counters.blocks_swapped_out += len(copies)
        if self.num_state_slots:
            host = self._free_swap_states.popleft()
            self._swapped_states[seq.seq_id] = host
            self.pending_state_swaps[0].append((seq.state_slot, host))
        self.free(seq)
        return copies

    def can_swap_in(self, seq: Sequence) -> bool:
        if self.num_state_slots and self._state_slots_wanted(seq) > len(self._free_state_slots):
            return False
        return self._held(self._swapped[seq.seq_id]) <= self.num_free_blocks

    @staticmethod
    def _state_slots_wanted(seq: Sequence) -> int:
        """State slots a sequence takes: one, and one per sample it will fork."""
        return len(seq.generators) if seq.pending_fork else 1

    def _take_state_slots(self, seq: Sequence) -> None:
        wanted = self._state_slots_wanted(seq)
        seq.state_slot = self._free_state_slots.popleft()
        seq.reserved_state_slots = [self._free_state_slots.popleft() for _ in range(wanted - 1)]

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks. Returns (host, device)
        copies to do before the next forward pass."""
        host_tables = self._swapped.pop(seq.seq_id)
        copies = []
        seq.block_tables = []
        if self.num_state_slots:
            host = self._swapped_states.pop(seq.seq_id)
            self._take_state_slots(seq)
            self.pending_state_swaps[1].append((host, seq.state_slot))
            self._free_swap_states.append(host)
        bs = self.block_size
        for g, host in enumerate(host_tables):
            table = []
            for i, host_id in enumerate(host):
                if host_id == NULL_BLOCK:
                    table.append(NULL_BLOCK)
                    continue
                table.append(self._take_block(g))
                copies.append((host_id, table[-1]))
                self._free_swap_ids.append(host_id)
                # Its full blocks can serve as prefix-cache entries again.
                hashes = seq.block_hashes
                if i < len(hashes) and (g, hashes[i]) not in self._hash_to_block:
                    parent = hashes[i - 1] if i else None
                    ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
                    self._register(self.blocks[table[-1]], g, hashes[i], parent, ids)
            seq.block_tables.append(table)
        self.counters.blocks_swapped_in += len(copies)
        return copies

    def drop_swapped(self, seq: Sequence) -> None:
        """Forget a swapped sequence's host blocks (it was aborted)."""
        for host in self._swapped.pop(seq.seq_id, []):
            self._free_swap_ids.extend(h for h in host if h != NULL_BLOCK)
        if seq.seq_id in self._swapped_states:
            self._free_swap_states.append(self._swapped_states.pop(seq.seq_id))

    def take_pending_state_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(device slot, host slot) states to copy out, (host, device) to copy in."""
        swaps, self.pending_state_swaps = self.pending_state_swaps, ([], [])
        return swaps

    @property
    def num_swapped_blocks(self) -> int:
        return self.num_swap_blocks - len(self._free_swap_ids)

    # ---- invariants ----------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent with `seqs`,
        the sequences that currently hold block tables."""
        holders = [0] * len(self.blocks)
        bs = self.block_size
        for seq in seqs:
            tables = seq.block_tables
            assert len(tables) == self.num_groups or not any(tables), "tables of another layout"
            assert len({len(t) for t in tables}) <= 1, "groups' tables of different lengths"
            for g, table in enumerate(tables):
                first = self.groups[g].first_needed_block(seq.num_computed_tokens, bs)
                for i, block_id in enumerate(table):
                    if block_id == NULL_BLOCK:
                        assert i < first, f"group {g} gave back block {i}, which it still reads"
                        continue
                    assert 0 <= block_id < len(self.blocks), f"block {block_id} never handed out"
                    assert self.blocks[block_id].group == g, f"block {block_id} in two groups"
                    holders[block_id] += 1
        free = set(self._free_ids)
        cached = set(self._cached_free)
        assert len(free) == len(self._free_ids), "a block is twice in the free list"
        assert not (free & cached), "a block is both free and cached-free"
        num_in_use = 0
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} but held by "
                f"{holders[block.block_id]} block tables"
            )
            in_free = block.block_id in free
            in_cached = block.block_id in cached
            in_use = block.ref_count > 0
            assert in_free + in_cached + in_use == 1, f"block {block.block_id} is in >1 state"
            num_in_use += in_use
            if in_free:
                assert block.hash is None, f"free block {block.block_id} has a hash"
            if in_cached:
                assert block.hash is not None, f"cached-free block {block.block_id} lacks a hash"
            if block.hash is not None:
                assert self._hash_to_block.get((block.group, block.hash)) == block.block_id
        assert all(b.block_id == i for i, b in enumerate(self.blocks)), "blocks out of order"
        assert len(free) + len(cached) + num_in_use == len(self.blocks)
        for (g, h), block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h and self.blocks[block_id].group == g
        held_slots = [
            slot
            for seq in seqs
            for slot in ([seq.state_slot] if seq.state_slot is not None else [])
            + seq.reserved_state_slots
        ]
        assert len(set(held_slots)) == len(held_slots), "a state slot is held twice"
        assert not (set(held_slots) & set(self._free_state_slots)), "a state slot free and held"
        assert len(held_slots) + len(self._free_state_slots) == self.num_state_slots
        snapshot_slots = list(self._snapshots.values())
        assert len(set(snapshot_slots)) == len(snapshot_slots), "a snapshot slot is held twice"
        assert set(snapshot_slots) == set(self._snapshot_keys), "snapshot keys out of step"
        assert not (set(snapshot_slots) & set(self._free_snapshots)), "a snapshot free and held"
        planned = [slot for _, slot, _ in self._planned]
        assert len(snapshot_slots) + len(planned) + len(self._free_snapshots) == self.num_snapshots
        for h, slot in self._snapshots.items():
            assert self._snapshot_keys[slot][0] == h
        host_states = list(self._swapped_states.values())
        assert len(set(host_states)) == len(host_states), "a host state slot is held twice"
        assert not (set(host_states) & set(self._free_swap_states)), "a host state free and held"
        assert len(host_states) + len(self._free_swap_states) == self.num_swap_states
        swapped = [h for tables in self._swapped.values() for t in tables for h in t]
        swapped = [h for h in swapped if h != NULL_BLOCK]
        assert len(set(swapped)) == len(swapped), "a host block is held twice"
        assert not (set(swapped) & set(self._free_swap_ids)), "a host block is free and held"
        assert len(swapped) + len(self._free_swap_ids) == self.num_swap_blocks
