"""KV cache groups: which layers share a block table, and how a block's bytes are laid out.

A hybrid model mixes layer types: Gemma 3 has five sliding-window layers (window 512-1024) to
one full-attention layer. A sliding-window layer never reads a block wholly before its
window, so that block can go back to the pool while the full-attention layers keep theirs.
That takes one block table per layer type, over one pool of equal pages (vLLM v1's hybrid
KV-cache manager does the same):

- A page (one block id) holds `slots` layers' K/V for `block_size` tokens: the cache is
  [K/V, slots, num_blocks, block_size, kv_heads, head_dim], and a layer reads slot j of the
  blocks in its group's table.
- A layer type with n layers makes ceil(n / slots) groups; every group has its own table per
  sequence (full groups identical in shape, window groups freeing the same positions).
  `slots` is chosen to waste the fewest slots (groups short of `slots` layers leave the rest
  of their pages unused), one slot counted against each extra table a step must build.
- A uniform model is one group of all its layers: the layout and the block count of a plain
  paged cache.

A window at least as long as the longest sequence frees nothing: such layers count as full.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers that share a block table: `window` None for full attention (blocks are kept),
    else the tokens a query sees (itself included), past which blocks are freed; `layers`:
    the attention layers' indices, in slot order."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full attention" if self.window is None else f"window {self.window}"

    def first_needed_block(self, num_computed: int, block_size: int) -> int:
        """The first block a query at position `num_computed` (and every later one) reads:
        blocks before it are wholly outside the window."""
        if self.window is None:
            return 0
        return max(0, num_computed - self.window + 1) // block_size


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    slots: int  # layers per page

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        """Whether any group frees blocks (a window group)."""
        return any(g.window is not None for g in self.groups)

    def placement(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, slot) of each attention layer."""
        place = [(-1, -1)] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                place[layer] = (g, slot)
        return place

    def describe(self) -> str:
        """e.g. "pages of 4 layers: 1 full-attention table, 6 window-512 tables"."""
        if self.num_groups == 1 and not self.hybrid:
            return f"pages of {self.slots} layers"
        counts: dict[str, int] = {}
        for group in self.groups:
            name = "full-attention" if group.window is None else f"window-{group.window}"
            counts[name] = counts.get(name, 0) + 1
        tables = ", ".join(f"{n} {name} table{'s' * (n > 1)}" for name, n in counts.items())
        return f"pages of {self.slots} layers: {tables}"


def plan_kv_groups(windows: list[int | None], max_model_len: int, hybrid: bool = True) -> KVGroups:
    """The groups of a model whose attention layers have these windows (None: full).

    `hybrid` False: one group of every layer, which keeps every block (each layer still
    attends within its own window), as a cache without groups does."""
    if not windows:
        raise ValueError("a model without attention layers has no KV cache")
    kinds = [None if w is None or w >= max_model_len else int(w) for w in windows]
    if not hybrid:
        return KVGroups((KVGroup(None, tuple(range(len(kinds)))),), len(kinds))
    types: dict[int | None, list[int]] = {}
    for i, kind in enumerate(kinds):
        types.setdefault(kind, []).append(i)
    order = sorted(types, key=lambda w: -1 if w is None else w)  # full attention first
    if len(order) == 1:
        return KVGroups((KVGroup(order[0], tuple(types[order[0]])),), len(kinds))
    smallest = min(len(layers) for layers in types.values())

    def cost(slots: int) -> tuple[int, int]:
        tables = sum(-(-len(layers) // slots) for layers in types.values())
        return (tables * slots + tables, -slots)  # slots held, one per table; then larger

    slots = min(range(1, smallest + 1), key=cost)
    groups = []
    for kind in order:
        layers = types[kind]
        for start in range(0, len(layers), slots):
            groups.append(KVGroup(kind, tuple(layers[start : start + slots])))
    return KVGroups(tuple(groups), slots)
