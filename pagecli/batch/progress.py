"""Progress of `pagecli generate` on stderr: a transient Rich line on a terminal, plain lines
once a second otherwise (with `--progress`), and a summary at the end.

The renderer is a pure function of `ProgressState`; the generate loop owns the updates, so
nothing reads the engine from another thread.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from pagecli.engine.stats import EngineStats

MIN_INTERVAL_S = 0.1  # at most 10 refreshes a second
PLAIN_INTERVAL_S = 1.0


@dataclass
class ProgressState:
    """Plain numbers for the progress line."""

    done: int = 0
    total: int | None = None  # known once the input has ended
    errors: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    running: int = 0
    waiting: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    elapsed_s: float = 0.0


def progress_text(state: ProgressState) -> str:
    """One line: records done/total, errors, tokens/s, running/waiting."""
    total = "?" if state.total is None else str(state.total)
    parts = [f"{state.done}/{total} records"]
    if state.errors:
        parts.append(f"{state.errors} errors")
    if state.skipped:
        parts.append(f"{state.skipped} skipped (--resume)")
    parts.append(
        f"{state.decode_tokens_per_s:.0f} tok/s decode, {state.prefill_tokens_per_s:.0f} prefill"
    )
    parts.append(f"running {state.running}, waiting {state.waiting}")
    return " · ".join(parts)


def summary_text(state: ProgressState) -> str:
    """The closing line: what was done and the overall generated tokens/s."""
    rate = state.completion_tokens / state.elapsed_s if state.elapsed_s else 0.0
    return (
        f"{state.done} records ({state.errors} errors) in {state.elapsed_s:.1f} s · "
        f"{state.prompt_tokens} prompt + {state.completion_tokens} generated tokens · "
        f"{rate:.1f} generated tok/s"
    )


class GenerateProgress:
    """Shows `ProgressState` on stderr when enabled; every method is a no-op otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.live_mode = enabled and self.console.is_terminal
        self.state = ProgressState()
        self._live: Live | None = None
        self._spinner = Spinner("dots", text="")
        self._last = 0.0
        self._start = time.perf_counter()

    def loading(self, name: str) -> AbstractContextManager:
        """A spinner while the model loads (terminal only)."""
        if self.live_mode:
            return self.console.status(f"loading {name}…", spinner="dots")
        return nullcontext()

    def start(self) -> None:
        self._start = time.perf_counter()
        if self.live_mode:
            self._live = Live(
                self._spinner, console=self.console, transient=True, auto_refresh=False
            )
            self._live.start()

    def update(self, stats: EngineStats | None = None, force: bool = False) -> None:
        """Refresh if enough time has passed (or `force`); `stats` is read only then."""
        if not self.enabled:
            return
        now = time.perf_counter()
        interval = MIN_INTERVAL_S if self.live_mode else PLAIN_INTERVAL_S
        if not force and now - self._last < interval:
            return
        self._last = now
        if stats is not None:
            self.state.running, self.state.waiting = stats.num_running, stats.num_waiting
            self.state.prefill_tokens_per_s = stats.prefill_tokens_per_s
            self.state.decode_tokens_per_s = stats.decode_tokens_per_s
        self.state.elapsed_s = now - self._start
        if self._live is not None:
            self._spinner.update(text=progress_text(self.state))
            self._live.refresh()
        else:
            print(f"pagecli: {progress_text(self.state)}", file=sys.stderr, flush=True)

    def wants_stats(self) -> bool:
        """Whether the next update would show (so the caller takes a stats snapshot)."""
        interval = MIN_INTERVAL_S if self.live_mode else PLAIN_INTERVAL_S
        return self.enabled and time.perf_counter() - self._last >= interval

    def stop(self, summary: bool = True) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self.enabled and summary:
            self.state.elapsed_s = time.perf_counter() - self._start
            print(f"pagecli: {summary_text(self.state)}", file=sys.stderr, flush=True)
