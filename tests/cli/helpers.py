"""Run the real `pagecli` process and read what it writes, with timeouts."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_script = Path(sys.executable).with_name("pagecli")
PAGECLI = [str(_script)] if _script.exists() else [shutil.which("pagecli") or "pagecli"]
# Small and deterministic: greedy, a few tokens, a small KV cache.
FAST = ["--temperature", "0", "--max-tokens", "6", "--kv-cache-memory", "0.25"]
TIMEOUT_S = 180  # a loaded 2-core machine can take a while to start the engine


def env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"}


def jsonl(*records: dict | bytes | str) -> bytes:
    """Input lines: dicts as JSON, bytes and str as given."""
    lines = []
    for r in records:
        if isinstance(r, dict):
            r = json.dumps(r)
        lines.append(r if isinstance(r, bytes) else r.encode())
    return b"\n".join(lines) + b"\n"


def run(args: list[str], stdin: bytes = b"", timeout: float = TIMEOUT_S):
    """Run pagecli to the end; stdout and stderr as text."""
    return subprocess.run(
        PAGECLI + args, input=stdin, capture_output=True, timeout=timeout, env=env()
    )


def _default_sigint() -> None:
    # A test runner started in the background (`cmd &` without job control) ignores SIGINT,
    # and a child inherits that: pagecli then rightly keeps ignoring Ctrl-C until its own
    # handlers are installed. The tests play a user at a terminal, where Ctrl-C is live.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        PAGECLI + args,
        stdin=kw.pop("stdin", subprocess.PIPE),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env(),
        preexec_fn=_default_sigint,
        **kw,
    )


def records(stdout: bytes) -> list[dict]:
    """Every stdout line parsed: each must be one whole JSON object ending in a newline."""
    text = stdout.decode()
    assert text == "" or text.endswith("\n"), f"a record was cut short: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


class LineReader:
    """Reads a pipe's lines on a thread, so a test can wait for one with a timeout."""

    def __init__(self, pipe) -> None:
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[bytes] = []
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe) -> None:
        for line in iter(pipe.readline, b""):
            self.lines.put(line)
        self.lines.put(None)

    def next(self, timeout: float = TIMEOUT_S) -> bytes:
        line = self.lines.get(timeout=timeout)
        assert line is not None, "the stream ended"
        self.seen.append(line)
        return line

    def until(self, predicate, timeout: float = TIMEOUT_S) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            line = self.next(max(deadline - time.monotonic(), 0.01))
            if predicate(line):
                return line

    def rest(self, timeout: float = 30) -> bytes:
        out = b""
        while (line := self.lines.get(timeout=timeout)) is not None:
            out += line
        return out


def no_traceback(stderr: bytes) -> None:
    assert b"Traceback" not in stderr, stderr.decode()
