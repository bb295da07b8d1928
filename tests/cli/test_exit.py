"""How the console script leaves after a failure or a Ctrl-C while the engine's thread is at
work in torch: with its own exit code, the exit handlers run and the output flushed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagecli.cli.app import _leave
from pagecli.config import EngineConfig
from pagecli.engine.async_engine import AsyncEngine, engine_at_work

SCRIPT = """
import atexit, sys, threading, time
import torch
from pagecli.cli.app import _leave
from pagecli.engine import async_engine

class Building:  # an engine whose thread is building its model: torch ops that release and
    at_work = True  # take back the GIL

    def __init__(self):
        self.thread = threading.Thread(target=self.build, daemon=True)
        self.thread.start()

    def build(self):
        while True:
            torch.empty(1 << 14)

engine = Building()
async_engine._ENGINES.add(engine)
time.sleep(0.3)
atexit.register(lambda: print("handlers ran", file=sys.stderr))
sys.stdout.write("finished work")  # not flushed yet
_leave(130)
"""


def test_an_engine_at_work_does_not_abort_the_exit():
    """CPython's shutdown would end the busy daemon thread inside torch's C++ and abort the
    process (SIGABRT, "terminate called without an active exception"); _leave exits with
    the code it was given instead, after the exit handlers, with stdout flushed."""
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, timeout=120, check=False
        )
        err = done.stderr.decode()
        assert done.returncode == 130, err
        assert "terminate called" not in err
        assert "handlers ran" in err
        assert done.stdout == b"finished work"


def test_without_an_engine_at_work_the_exit_is_the_interpreters():
    """An engine that never started (or sits idle) is not at work: _leave raises SystemExit
    as sys.exit does, so code that calls main() in-process (tests) keeps its process."""
    engine = AsyncEngine(EngineConfig())  # never started: no model is loaded
    assert not engine.at_work
    assert not engine_at_work()
    with pytest.raises(SystemExit) as leaving:
        _leave(2)
    assert leaving.value.code == 2
