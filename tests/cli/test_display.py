"""The block display: renderers on fixed EngineStats snapshots, the live helper, and
`pagecli generate --display` under a pseudo-terminal."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import time

import pytest
from rich.console import Console

from pagecli.cli import display
from pagecli.cli.display import LiveDisplay, block_map, cell_states, legend, render, stats_table
from pagecli.engine.stats import EngineStats
from tests.cli.helpers import PAGECLI, env, jsonl, run


def snapshot(states: list[str], **overrides) -> EngineStats:
    """A fixed snapshot whose counts agree with `states`."""
    used = sum(s in ("used", "shared") for s in states)
    fields = dict(
        num_blocks=len(states),
        block_size=16,
        blocks_in_use=used,
        blocks_cached_free=states.count("cached"),
        blocks_free=states.count("free"),
        blocks_shared=states.count("shared"),
        blocks_swapped=3,
        tokens_held=used * 16 - 5,
        num_running=2,
        num_waiting=1,
        num_swapped=1,
        prefix_query_tokens=200,
        prefix_hit_tokens=50,
        cow_copies=4,
        evictions=6,
        preemptions_recompute=7,
        preemptions_swap=8,
        chunked_prefills=0,
        num_steps=10,
        prefill_tokens=100,
        decode_tokens=20,
        prefill_tokens_per_s=1234.5,
        decode_tokens_per_s=56.7,
        step_time_s=0.0125,
        block_states=tuple(states),
    )
    fields.update(overrides)
    return EngineStats(**fields)


def plain(renderable, width: int = 160) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def glyph(state: str) -> str:
    return display.STATES[state][0]


def test_one_cell_per_block_shows_each_state():
    states = ["used", "shared", "cached", "free", "used"]
    text = block_map(snapshot(states)).plain
    assert text == "".join(glyph(s) for s in states)
    assert len({glyph(s) for s in display.STATES}) == 4  # distinct without colour


def test_large_pools_group_blocks_and_the_legend_says_how_many():
    states = ["used"] * 3000 + ["free"] * 1096
    stats = snapshot(states)
    per_cell = display.blocks_per_cell(4096)
    assert per_cell == 4  # 64 x 16 cells
    cells = block_map(stats).plain.replace("\n", "")
    assert len(cells) == 1024
    assert cells[:750] == glyph("used") * 750 and cells[750:] == glyph("free") * 274
    assert "1 cell = 4 blocks" in legend(stats).plain
    assert "1 cell = 1 block of 16 tokens" in legend(snapshot(["free"] * 8)).plain


def test_a_group_shows_its_most_common_state_ties_to_the_busier():
    assert cell_states(("free", "free", "used", "cached"), 4) == ["free"]
    assert cell_states(("free", "used", "shared", "cached"), 4) == ["shared"]
    assert cell_states(("cached", "free"), 2) == ["cached"]


def test_the_numbers():
    stats = snapshot(["used"] * 6 + ["shared"] * 2 + ["cached"] * 4 + ["free"] * 8)
    text = plain(stats_table(stats))
    assert "8/20 (40.0%)" in text  # blocks in use / total
    assert "123/128 (96.1%)" in text  # tokens held / slots held
    assert "25.0%" in text  # prefix hit rate
    assert "7 recompute, 8 swap" in text
    assert "2/1/1" in text  # running / waiting / swapped
    assert "1,234.5" in text and "56.7" in text and "12.5 ms" in text
    legend_text = legend(stats).plain
    for label, count in [("shared", 2), ("in use", 6), ("cached-free", 4), ("free", 8)]:
        assert f"{label}" in legend_text and f" {count}" in legend_text
    assert "swapped to host: 3 blocks" in legend_text
    whole = plain(render(stats, header="3/5 records"))
    assert whole.startswith("3/5 records") and "COW copies" in whole and "evictions" in whole


def test_empty_pool_percentages_do_not_divide_by_zero():
    text = plain(stats_table(snapshot(["free"] * 4)))
    assert "0/4 (0.0%)" in text and "0/0 (-)" not in text.replace("-5/0", "")


def test_no_color_renders_plain_glyphs(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    console.print(render(snapshot(["used", "free"])))
    out = console.file.getvalue()
    assert "\x1b[3" not in out and glyph("used") in out  # no colour codes, still readable


class FakeEngine:
    def __init__(self, stats: EngineStats) -> None:
        self.calls = 0
        self._stats = stats

    def stats(self) -> EngineStats:
        self.calls += 1
        return self._stats


def test_live_display_is_throttled_and_transient():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120, color_system=None)
    engine = FakeEngine(snapshot(["used", "free"]))
    with LiveDisplay(console=console) as live:
        for _ in range(50):
            live.update(engine)
        assert engine.calls == 1  # at most one snapshot per 0.1 s
        time.sleep(live._next - time.perf_counter() + 0.01)
        live.update(engine)
        assert engine.calls == 2
    assert "blocks in use" in buffer.getvalue()


def test_a_slow_redraw_pushes_the_next_one_out(monkeypatch):
    live = LiveDisplay(console=Console(file=io.StringIO(), force_terminal=True))
    clock = iter([10.05])  # the redraw began at 10.0 and took 50 ms
    monkeypatch.setattr(display.time, "perf_counter", lambda: next(clock))
    live.schedule(10.0)
    assert live._next == pytest.approx(10.0 + 0.05 / display.MAX_DUTY)  # 10 s: 0.5% of the time


def test_disabled_live_display_takes_no_snapshot():
    engine = FakeEngine(snapshot(["free"]))
    with display.maybe_live_display(engine, enabled=False) as refresh:
        refresh()
    assert engine.calls == 0


def test_forced_display_on_a_non_terminal_prints_the_last_map_once():
    buffer = io.StringIO()
    with LiveDisplay(console=Console(file=buffer, width=120)) as live:
        live.update(FakeEngine(snapshot(["used", "cached"])))
    assert buffer.getvalue().count("blocks in use") == 1


# ---- a real terminal --------------------------------------------------------------------


def run_in_pty(args: list[str], stdin: bytes, timeout: float = 150) -> str:
    """Run pagecli with stderr on a pseudo-terminal; return everything the terminal saw."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        PAGECLI + args,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env={**env(), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
    )
    os.close(follower)
    proc.stdin.write(stdin)
    proc.stdin.close()
    screen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            screen += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    proc.wait(timeout=30)
    assert proc.returncode == 0, screen.decode(errors="replace")[-2000:]
    return screen.decode(errors="replace")


def generate_has_display() -> bool:
    return b"--display" in run(["generate", "--help"], timeout=60).stdout


def test_generate_display_under_a_pseudo_terminal():
    if not generate_has_display():
        pytest.skip("generate has no --display yet (display.generate_progress wires it)")
    prompts = jsonl({"id": 1, "prompt_token_ids": [504] * 40})
    screen = run_in_pty(
        [
            "generate",
            "--display",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--temperature",
            "0",
            "--num-kv-blocks",
            "64",
        ],
        prompts,
    )
    assert "blocks in use" in screen and "1 cell = 1 block of 16 tokens" in screen
    assert "1/1 records" in screen  # the progress line rides above the map
