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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagecli.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class BlockCounters:
    """Engine-wide counters since start-up (plain numbers, read by EngineStats)."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    cow_copies: int = 0
    evictions: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0


class BlockManager:
    """Owns which KV block holds what. Tensors live in the model runner: copies that the
    runner must perform (copy-on-write, swap) are returned or queued in `pending_copies`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        model_key: str = "",
        num_swap_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._root_hash = hash(("pagecli-prefix", model_key))
        # Blocks come into being when first handed out, in id order: ids from len(blocks) up
        # are free and were never used. A pool of millions of small blocks (a small model
        # under a large --kv-cache-memory) starts at once, and the walks over `blocks` (the
        # stats, the invariants) cover only the blocks ever used.
        self.blocks: list[Block] = []
        self._free_ids: deque[int] = deque()  # freed blocks, handed out after the unused
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) device blocks
        self.counters = BlockCounters()
        # Host pool for swapped-out sequences: seq_id -> host block ids, in table order.
        self.num_swap_blocks = num_swap_blocks
        self._free_swap_ids: deque[int] = deque(range(num_swap_blocks))
        self._swapped: dict[int, list[int]] = {}

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

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------

    def chain_hash(self, parent_hash: int | None, token_ids: tuple[int, ...], salt: int = 0) -> int:
        """A full block's hash: its parent's (the model's root, salted, for the first block)
        chained with its token ids."""
        if parent_hash is None:
            parent_hash = self._root_hash if not salt else hash((self._root_hash, salt))
        return hash((parent_hash, token_ids))

    def match_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks the longest run of cached blocks of its tokens.

        At least one token is always left to compute so that the model produces logits.
        Returns the number of tokens found; `seq.num_computed_tokens` is set to it.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError("match_prefix needs a sequence that holds no blocks")
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        self.counters.prefix_query_tokens += seq.num_tokens
        hashes = seq.block_hashes
        parent = None
        for i in range(num_full):
            ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hashes[i] if i < len(hashes) else self.chain_hash(parent, ids, seq.cache_salt)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != ids or block.parent_hash != parent:
                break  # a hash collision: treat as a miss
            if block.ref_count == 0:
                del self._cached_free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            if i == len(hashes):
                hashes.append(h)
            parent = h
        # Hashes kept from an earlier life (preemption) past the hit are recomputed on commit.
        del hashes[len(seq.block_table) :]
        num_hit = len(seq.block_table) * bs
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
        """How many full blocks of the sequence, right after those the prefix cache holds, are
        being computed in this step (by other sequences)."""
        if not self.enable_prefix_caching or not in_flight:
            return 0
        count = 0
        for h in self.full_block_hashes(seq, seq.num_tokens - 1):
            if h in self._hash_to_block and not count:
                continue
            if h not in in_flight:
                break
            count += 1
        return count

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Make the sequence's full, computed blocks findable by hash."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = seq.block_hashes
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else None
            ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.chain_hash(parent, ids, seq.cache_salt)
            hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._hash_to_block:
                self._register(block, h, parent, ids)
            # else: the same prefix is already cached in another block; this one stays private

    def _register(
        self, block: Block, h: int, parent: int | None, token_ids: tuple[int, ...]
    ) -> None:
        """Make a full, computed block findable by its chained hash."""
        block.hash, block.parent_hash, block.token_ids = h, parent, token_ids
        self._hash_to_block[h] = block.block_id

    @property
    def cached_free_ids(self) -> set[int]:
        """Blocks no sequence holds whose prefix hash is still findable."""
        return set(self._cached_free)

    # ---- allocation ----------------------------------------------------------------------

    def _take_block(self) -> int:
        if len(self.blocks) < self.num_blocks:  # the unused first, in id order
            block_id = len(self.blocks)
            self.blocks.append(Block(block_id))
        elif self._free_ids:
            block_id = self._free_ids.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)  # least recently used
            block = self.blocks[block_id]
            del self._hash_to_block[block.hash]
            block.hash = block.parent_hash = block.token_ids = None
            self.counters.evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._cached_free[block_id] = None  # most recently used end
            else:
                self._free_ids.append(block_id)

    def slots_cost(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks that `allocate_slots(seq, num_new_tokens)` would take."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        cost = max(0, needed - len(seq.block_table))
        if self._needs_cow(seq):
            cost += 1
        return cost

    def _needs_cow(self, seq: Sequence) -> bool:
        idx = seq.num_computed_tokens // self.block_size
        return idx < len(seq.block_table) and self.blocks[seq.block_table[idx]].ref_count > 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens` K/V entries of `seq`; False (and nothing
        changed) when there are not enough blocks. A shared block about to be written is
        copied first (copy-on-write)."""
        if self.slots_cost(seq, num_new_tokens) > self.num_free_blocks:
            return False
        if self._needs_cow(seq):
            idx = seq.num_computed_tokens // self.block_size
            src = seq.block_table[idx]
            dst = self._take_block()
            self._release(src)
            seq.block_table[idx] = dst
            self.pending_copies.append((src, dst))
            self.counters.cow_copies += 1
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            seq.block_table.append(self._take_block())
        return True

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past those the sequence's tokens need (speculative decoding:
        blocks that held only rejected drafts' K/V), last first."""
        needed = self.blocks_needed(seq.num_tokens)
        while len(seq.block_table) > needed:
            self._release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (prompt blocks, a partly filled last
        block included); whoever writes a shared block first copies it."""
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.blocks[block_id].ref_count += 1

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks. Tail blocks are released first so that
        they are evicted before the prefix blocks that others are more likely to share."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- swap ----------------------------------------------------------------------------

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self._free_swap_ids)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a sequence's blocks to the host pool. Returns (device, host) copies to do
        before the device blocks are reused."""
        host_ids = [self._free_swap_ids.popleft() for _ in seq.block_table]
        copies = list(zip(seq.block_table, host_ids))
        self._swapped[seq.seq_id] = host_ids
        self.counters.blocks_swapped_out += len(host_ids)
        self.free(seq)
        return copies

    def can_swap_in(self, seq: Sequence) -> bool:
        return len(self._swapped[seq.seq_id]) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back into fresh device blocks. Returns (host, device)
        copies to do before the next forward pass."""
        host_ids = self._swapped.pop(seq.seq_id)
        seq.block_table = [self._take_block() for _ in host_ids]
        self._free_swap_ids.extend(host_ids)
        self.counters.blocks_swapped_in += len(host_ids)
        # Its full blocks can serve as prefix-cache entries again.
        for i, h in enumerate(seq.block_hashes[: len(seq.block_table)]):
            block = self.blocks[seq.block_table[i]]
            if h not in self._hash_to_block:
                parent = seq.block_hashes[i - 1] if i else None
                ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                self._register(block, h, parent, ids)
        return list(zip(host_ids, seq.block_table))

    def drop_swapped(self, seq: Sequence) -> None:
        """Forget a swapped sequence's host blocks (it was aborted)."""
        self._free_swap_ids.extend(self._swapped.pop(seq.seq_id, []))

    @property
    def num_swapped_blocks(self) -> int:
        return self.num_swap_blocks - len(self._free_swap_ids)

    # ---- invariants ----------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError when the pool's bookkeeping is inconsistent with `seqs`,
        the sequences that currently hold block tables."""
        holders = [0] * len(self.blocks)
        for seq in seqs:
            for block_id in seq.block_table:
                assert block_id < len(self.blocks), f"block {block_id} was never handed out"
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
                assert self._hash_to_block.get(block.hash) == block.block_id
        assert all(b.block_id == i for i, b in enumerate(self.blocks)), "blocks out of order"
        assert len(free) + len(cached) + num_in_use == len(self.blocks)
        for h, block_id in self._hash_to_block.items():
            assert self.blocks[block_id].hash == h
        swapped = [h for ids in self._swapped.values() for h in ids]
        assert len(set(swapped)) == len(swapped), "a host block is held twice"
        assert not (set(swapped) & set(self._free_swap_ids)), "a host block is free and held"
        assert len(swapped) + len(self._free_swap_ids) == self.num_swap_blocks
