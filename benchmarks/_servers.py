"""Starting a server for the benchmark scripts in this folder."""

from __future__ import annotations

import subprocess
import time

import httpx


def start_and_wait(command: list[str], port: int, name: str, timeout: float = 300):
    """Run `command` (a server on 127.0.0.1:`port`, its output discarded) and return its
    process once GET /health answers 200; SystemExit naming `name` if it exits first or does
    not answer within `timeout` seconds (it is killed then)."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited ({proc.returncode}): {' '.join(command)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{name} did not start")
