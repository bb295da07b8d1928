"""`pagecli serve -tp 2`: the seed's streaming snippet is answered; /metrics shows the size;
a worker that dies ends the server with one line and a non-zero exit, leaving no process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.cli.test_tensor_parallel_cli import _alive, _worker
from tests.server.conftest import SEED_MODEL, Server
from tests.server.test_serve import seed_snippet


def test_serve_tp2_answers_the_seed_snippet_then_ends_when_a_worker_dies():
    srv = Server(
        [
            "-tp",
            "2",
            "--threads",
            "1",
            "--served-model-name",
            SEED_MODEL,
            "--kv-cache-memory",
            "0.5",
        ]
    )
    try:
        code = seed_snippet(srv.base_url)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.decode().strip(), "the snippet printed no text"
        assert srv.metrics()["pagecli:tensor_parallel_size"] == 2

        worker = _worker(srv.proc.pid, time.monotonic() + 10)
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        code = srv.proc.wait(timeout=30)
        assert time.monotonic() - killed < 10
        assert code == 1
        err = srv.stderr()
        assert "pagecli: the engine stopped: tensor-parallel rank 1 died (killed by SIGKILL)" in err
        assert "Traceback" not in err
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the dead worker's process was left behind"
        try:
            httpx.get(f"{srv.url}/health", timeout=2)
            raise AssertionError("the server still answers after its worker died")
        except httpx.HTTPError:
            pass
    finally:
        srv.stop()
