"""The live block display: pure functions from an `EngineStats` snapshot to Rich renderables,
and `LiveDisplay`, which shows them on stderr (transient, at most 10 refreshes a second).

Each cell of the map is one KV block, or a group of blocks when the pool is larger than the
area (the legend says how many per cell; a group shows its most common state). Every state has
its own glyph, so the map reads the same with `NO_COLOR` set.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import groupby
from typing import TYPE_CHECKING, Optional

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pagecli.batch.progress import GenerateProgress, progress_text
from pagecli.engine.stats import EngineStats

if TYPE_CHECKING:
    from pagecli.engine.llm_engine import LLMEngine

MIN_INTERVAL_S = 0.1  # at most 10 refreshes a second
MAX_DUTY = 0.005  # and at most 0.5% of the time: a slow redraw pushes the next one further out
MAP_WIDTH = 64  # cells per row
MAP_ROWS = 16  # rows before blocks are grouped into cells
STATS_WIDTH = 46  # columns the numbers beside the map take

# state -> (glyph, style, legend label); the order is the legend's and the tie-break's.
STATES: dict[str, tuple[str, str, str]] = {
    "shared": ("▓", "bold magenta", "shared (ref > 1)"),
    "used": ("█", "green", "in use"),
    "cached": ("▒", "cyan", "cached-free (evictable)"),
    "free": ("·", "grey50", "free"),
}
_PRIORITY = {state: rank for rank, state in enumerate(STATES)}


def blocks_per_cell(num_blocks: int, width: int = MAP_WIDTH, max_rows: int = MAP_ROWS) -> int:
    """How many blocks one cell stands for, so that the map fits `width` x `max_rows`."""
    return max(1, math.ceil(num_blocks / (width * max_rows)))


def cell_states(block_states: tuple[str, ...], per_cell: int) -> list[str]:
    """One state per cell: the most common state of its blocks, ties going to the busier one."""
    if per_cell == 1:
        return list(block_states)
    cells = []
    for start in range(0, len(block_states), per_cell):
        counts = Counter(block_states[start : start + per_cell])
        cells.append(min(counts, key=lambda s: (-counts[s], _PRIORITY.get(s, len(STATES)))))
    return cells


def block_map(stats: EngineStats, width: int = MAP_WIDTH, max_rows: int = MAP_ROWS) -> Text:
    """The grid of cells, `width` per row (one styled span per run of equal cells)."""
    per_cell = blocks_per_cell(stats.num_blocks, width, max_rows)
    cells = cell_states(stats.block_states, per_cell)
    text = Text(no_wrap=True)
    for start in range(0, len(cells), width):
        if start:
            text.append("\n")
        for state, run in groupby(cells[start : start + width]):
            glyph, style, _ = STATES.get(state, ("?", "red", state))
            text.append(glyph * len(list(run)), style=style)
    return text


def legend(stats: EngineStats, width: int = MAP_WIDTH, max_rows: int = MAP_ROWS) -> Text:
    """What a cell stands for, each state's glyph and count, and the swapped-out blocks."""
    per_cell = blocks_per_cell(stats.num_blocks, width, max_rows)
    counts = Counter(stats.block_states)
    unit = "1 block" if per_cell == 1 else f"{per_cell} blocks (most common state)"
    text = Text(f"1 cell = {unit} of {stats.block_size} tokens\n")
    for state, (glyph, style, label) in STATES.items():
        text.append(glyph, style=style)
        text.append(f" {label} {counts.get(state, 0)}   ")
    text.append(f"\nswapped to host: {stats.blocks_swapped} blocks")
    return text


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def stats_table(stats: EngineStats) -> Table:
    """The numbers beside the map."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    used = stats.blocks_in_use
    slots = used * stats.block_size
    rows = [
        ("blocks in use", f"{used}/{stats.num_blocks} ({_pct(used, stats.num_blocks)})"),
        ("tokens held/slots", f"{stats.tokens_held}/{slots} ({_pct(stats.tokens_held, slots)})"),
        ("prefix hit rate", f"{100 * stats.prefix_hit_rate:.1f}%"),
        ("shared blocks", str(stats.blocks_shared)),
        ("cached-free blocks", str(stats.blocks_cached_free)),
        ("COW copies", str(stats.cow_copies)),
        ("evictions", str(stats.evictions)),
        (
            "preemptions",
            f"{stats.preemptions_recompute} recompute, {stats.preemptions_swap} swap",
        ),
        ("run/wait/swapped seqs", f"{stats.num_running}/{stats.num_waiting}/{stats.num_swapped}"),
        ("prefill tok/s", f"{stats.prefill_tokens_per_s:,.1f}"),
        ("decode tok/s", f"{stats.decode_tokens_per_s:,.1f}"),
        ("step time", f"{1000 * stats.step_time_s:,.1f} ms"),
    ]
    if len(stats.kv_groups) > 1:  # a hybrid model: each layer type's table
        rows += _group_rows(stats)
    if stats.state_slots:  # recurrent layers
        rows += [
            ("state slots", f"{stats.state_slots_in_use}/{stats.state_slots}"),
            ("state snapshots", f"{stats.state_snapshots_held}/{stats.state_snapshots}"),
        ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _group_rows(stats: EngineStats) -> list[tuple[str, str]]:
    """Blocks in use per kind of KV cache table (tables of one kind summed), and the blocks
    windows gave back."""
    kinds: dict[str, tuple[int, int]] = {}
    for kind, used in zip(stats.kv_groups, stats.group_blocks_in_use):
        tables, blocks = kinds.get(kind, (0, 0))
        kinds[kind] = (tables + 1, blocks + used)
    rows = [
        (f"  {kind} ({tables} table{'s' * (tables > 1)})", f"{blocks} blocks")
        for kind, (tables, blocks) in kinds.items()
    ]
    return rows + [("  window freed", f"{stats.window_freed_blocks} blocks")]


def render(stats: EngineStats, width: int = MAP_WIDTH, header: Optional[str] = None) -> Group:
    """The whole display: an optional header line, the map beside the numbers, the legend."""
    width = max(8, width)
    side = Table.grid(padding=(0, 3))
    side.add_row(block_map(stats, width), stats_table(stats))
    parts: list[RenderableType] = [Text(header)] if header else []
    parts += [side, legend(stats, width)]
    return Group(*parts)


def map_width_for(console: Console) -> int:
    """Cells per row that leave room for the numbers beside the map."""
    return max(16, min(MAP_WIDTH, console.width - STATS_WIDTH))


class LiveDisplay:
    """The block display, live on stderr while it is open; `update` is cheap when not due.

    On a terminal it animates and disappears when closed (transient). Forced on a
    non-terminal (`--display` into a file), it prints the last map once when closed.
    Rich's Console honours `NO_COLOR`.
    """

    def __init__(self, enabled: bool = True, console: Optional[Console] = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._live: Optional[Live] = None
        self._next = 0.0  # perf_counter() time when the next redraw is due
        self._latest: Optional[EngineStats] = None
        self.header: Optional[str] = None

    def __enter__(self) -> LiveDisplay:
        if self.enabled and self.console.is_terminal:
            self._live = Live(Text(""), console=self.console, transient=True, auto_refresh=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif self._latest is not None and exc[0] is None:
            self.console.print(self.renderable(self._latest))

    def due(self) -> bool:
        """Whether the next `update` would redraw."""
        return time.perf_counter() >= self._next

    def schedule(self, started: float) -> None:
        """After a redraw that began at `started`: the next one comes 0.1 s later, or later
        still when the redraw was slow, so the display never takes over 0.5% of the time."""
        cost = time.perf_counter() - started
        self._next = started + max(MIN_INTERVAL_S, cost / MAX_DUTY)

    def renderable(self, stats: EngineStats) -> Group:
        return render(stats, map_width_for(self.console), self.header)

    def update(self, engine: LLMEngine, force: bool = False) -> None:
        """Take a snapshot and redraw when due (unless `force`)."""
        if not self.enabled or (not force and not self.due()):
            return
        started = time.perf_counter()
        self.show(engine.stats())
        self.schedule(started)

    def show(self, stats: EngineStats) -> None:
        self._latest = stats
        if self._live is not None:
            self._live.update(self.renderable(stats), refresh=True)


@contextmanager
def maybe_live_display(engine: LLMEngine, enabled: Optional[bool]) -> Iterator[Callable[..., None]]:
    """`with maybe_live_display(engine, flag) as refresh:` call `refresh()` after each step.

    `enabled=None` means: when stderr is a terminal. Disabled, `refresh` does nothing.
    """
    if enabled is None:
        enabled = sys.stderr.isatty()
    with LiveDisplay(enabled) as live:
        yield lambda force=False: live.update(engine, force)
        live.update(engine, force=True)


class DisplayProgress(GenerateProgress):
    """`generate`'s progress with the block map under the progress line (`--display`)."""

    def __init__(self, enabled: bool) -> None:
        super().__init__(enabled=True)
        self.progress_enabled = enabled
        self.live_mode = self.console.is_terminal
        self._display = LiveDisplay(console=self.console)
        self._stats: Optional[EngineStats] = None
        self._asked = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()
        self._display.__enter__()

    def wants_stats(self) -> bool:
        if self._display.due():
            self._asked = time.perf_counter()  # the caller's snapshot counts toward the cost
            return True
        return False

    def update(self, stats: Optional[EngineStats] = None, force: bool = False) -> None:
        if not force and not self._display.due():
            return
        started = self._asked if stats is not None and self._asked else time.perf_counter()
        self._asked = 0.0
        if stats is not None:
            self._stats = stats
            self.state.running, self.state.waiting = stats.num_running, stats.num_waiting
            self.state.prefill_tokens_per_s = stats.prefill_tokens_per_s
            self.state.decode_tokens_per_s = stats.decode_tokens_per_s
        self.state.elapsed_s = time.perf_counter() - self._start
        if self._stats is not None:
            self._display.header = progress_text(self.state)
            self._display.show(self._stats)
        self._display.schedule(started)

    def stop(self, summary: bool = True) -> None:
        self._display.__exit__(None, None, None)
        if self.progress_enabled and summary:
            from pagecli.batch.progress import summary_text

            self.state.elapsed_s = time.perf_counter() - self._start
            print(f"pagecli: {summary_text(self.state)}", file=sys.stderr, flush=True)


def generate_progress(progress: bool, display: Optional[bool]) -> GenerateProgress:
    """What `generate` shows on stderr: the block display when `display` (None: when stderr is
    a terminal and progress is on), else the plain progress line."""
    if display is None:
        display = progress and sys.stderr.isatty()
    return DisplayProgress(progress) if display else GenerateProgress(progress)
