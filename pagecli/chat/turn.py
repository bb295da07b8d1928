"""One chat turn: stream the reply, stop it on Ctrl-C, and sum it up in one stats line."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pagecli.chat.state import ChatError, Conversation
from pagecli.errors import BackendError, RequestError, RequestRejected
from pagecli.outputs import RequestOutput


@dataclass(frozen=True)
class TurnStats:
    """What one turn cost: prompt tokens computed and reused, latency and speed."""

    num_prompt_tokens: int | None  # None: a server that did not say (an interrupted turn)
    num_cached_tokens: int | None
    num_generated_tokens: int | None
    time_to_first_token: float | None
    tokens_per_s: float | None
    finish_reason: str | None
    interrupted: bool

    remote: bool = False  # counted by a server (prompt and cached tokens), not here
    # speculative decoding in this turn (local engine): decodes that checked drafts, the
    # drafts, those accepted
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def num_prefilled_tokens(self) -> int:
        return self.num_prompt_tokens - (self.num_cached_tokens or 0)

    @classmethod
    def of(cls, output: RequestOutput, interrupted: bool, remote: bool = False) -> TurnStats:
        metrics = output.metrics
        server = output.server
        if server is not None:
            num_prompt, num_cached = server.prompt_tokens, server.cached_tokens
            num_generated = server.completion_tokens
        elif remote:  # stopped before the server's final count
            num_prompt = num_cached = num_generated = None
        else:
            num_prompt, num_cached = len(output.prompt_token_ids), output.num_cached_tokens
            num_generated = len(output.token_ids)
        first = metrics.get("first_token_time")
        end = metrics.get("finished_time", time.perf_counter())
        # Decode speed: the tokens after the first, over the time since the first.
        rate = (
            (num_generated - 1) / (end - first)
            if first and num_generated is not None and num_generated > 1
            else None
        )
        return cls(
            num_prompt_tokens=num_prompt,
            num_cached_tokens=num_cached,
            num_generated_tokens=num_generated,
            time_to_first_token=metrics.get("time_to_first_token"),
            tokens_per_s=rate if rate and end > first else None,
            finish_reason=output.finish_reason,
            interrupted=interrupted,
            remote=remote,
        )

    def line(self) -> str:
        """`29 prefilled · 16 reused · TTFT 0.41 s · 12 tokens at 8.3 tok/s`; from a server:
        `45 prompt tokens · 32 cached · TTFT ...` (cached only when the server says)."""
        parts = []
        if self.remote:
            if self.num_prompt_tokens is not None:
                parts.append(f"{self.num_prompt_tokens} prompt tokens")
            if self.num_cached_tokens is not None:
                parts.append(f"{self.num_cached_tokens} cached")
        else:
            parts += [f"{self.num_prefilled_tokens} prefilled", f"{self.num_cached_tokens} reused"]
        if self.time_to_first_token is not None:
            parts.append(f"TTFT {self.time_to_first_token:.2f} s")
        if self.num_generated_tokens is not None:
            tokens = f"{self.num_generated_tokens} tokens"
            if self.tokens_per_s is not None:
                tokens += f" at {self.tokens_per_s:.1f} tok/s"
            parts.append(tokens)
        if self.spec_drafts:
            rate = self.spec_accepted_tokens / self.spec_draft_tokens
            mean = 1 + self.spec_accepted_tokens / self.spec_drafts
            parts.append(f"drafts {rate:.0%} accepted, {mean:.1f} tokens a step")
        if self.interrupted:
            parts.append("interrupted")
        elif self.finish_reason == "length":
            parts.append("max_tokens reached (/set max_tokens N)")
        return " · ".join(parts)


@contextmanager
def ctrl_c_stops(enabled: bool = True) -> Iterator[Callable[[], bool]]:
    """While active, a first Ctrl-C asks the reply to stop after the current engine step (so
    the engine is never interrupted half-way); a second one raises KeyboardInterrupt at once.
    Yields a function telling whether a stop was asked."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    asked = False

    def handler(signum, frame):
        nonlocal asked
        if asked:
            raise KeyboardInterrupt
        asked = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: asked
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def no_ctrl_echo() -> Iterator[None]:
    """Keep the terminal from echoing `^C` into the reply while it streams (stdin a tty)."""
    saved = None
    try:
        import termios

        fd = sys.stdin.fileno()
        if os.isatty(fd):
            saved = termios.tcgetattr(fd)
            quiet = list(saved)
            quiet[3] &= ~termios.ECHOCTL  # [3]: the local modes
            termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except (ImportError, AttributeError, OSError, ValueError):
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSANOW, saved)


def run_turn(
    conversation: Conversation,
    user_text: str,
    write: Callable[[str], None],
    stoppable: bool = True,
) -> TurnStats | None:
    """Send one user message and write the reply's text as it arrives. When `stoppable`, a
    Ctrl-C stops the reply (else KeyboardInterrupt propagates); either way the conversation
    keeps what was generated. Returns None when nothing was generated before the stop; raises
    ChatError when the engine or the server refuses the prompt or is gone."""
    session = conversation.session
    backend = session.llm  # a SyncBackend
    ids_before = list(session.token_ids)
    spec_before = _spec_counts(backend)
    conversation.begin_turn()
    last = None
    interrupted = False
    stream = session.stream(user_text, conversation.sampling_params())
    with ctrl_c_stops(stoppable) as stop_asked, no_ctrl_echo(), backend.stoppable(stop_asked):
        try:
            for last in stream:
                write(last.delta)
                if stop_asked():
                    break
            interrupted = stop_asked() and not (last is not None and last.finished)
        except KeyboardInterrupt:
            if not stoppable:
                raise
            interrupted = True
        except (RequestError, RequestRejected) as exc:
            hint = " (/clear or /new starts afresh)" if conversation.num_turns else ""
            raise ChatError(f"{exc}{hint}") from None
        except BackendError as exc:
            raise ChatError(str(exc)) from None
        finally:
            stream.close()  # aborts the request; the session records what it has
            conversation.end_turn(ids_before)
    if last is None:
        return None
    stats = TurnStats.of(last, interrupted, remote=not backend.is_local)
    if spec_before is not None:  # the engine ran this turn alone: the counts' difference
        drafts, draft_tokens, accepted = (a - b for a, b in zip(_spec_counts(backend), spec_before))
        stats = dataclasses.replace(
            stats,
            spec_drafts=drafts,
            spec_draft_tokens=draft_tokens,
            spec_accepted_tokens=accepted,
        )
    return stats


def _spec_counts(backend) -> tuple[int, int, int] | None:
    """The local engine's speculative-decoding counters (None: a server, or it is off)."""
    if not backend.is_local or backend.engine.config.speculative_config is None:
        return None
    counters = backend.engine.scheduler.counters
    return counters.spec_drafts, counters.spec_draft_tokens, counters.spec_accepted_tokens
