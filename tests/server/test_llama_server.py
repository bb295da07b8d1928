"""`--endpoint` against llama.cpp's `llama-server`, a server nobody here wrote, on the default
model's GGUF file. Skips (with the reason) where the peer binaries are absent or cannot run:
they live in $PAGECLI_PEERS/llama.cpp, else in ../shared/peers/llama.cpp beside the checkout,
else in /work/shared/peers/llama.cpp (where this project's machines keep them, for a clone
made anywhere else)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cli.helpers import jsonl, no_traceback, records, run
from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [
    *([Path(os.environ["PAGECLI_PEERS"])] if os.environ.get("PAGECLI_PEERS") else []),
    ROOT.parent / "shared" / "peers",
    Path("/work/shared/peers"),
]
BINARY = next(
    (c / "llama.cpp" / "bin" / "llama-server" for c in CANDIDATES if (c / "llama.cpp").is_dir()),
    CANDIDATES[0] / "llama.cpp" / "bin" / "llama-server",
)


def _runnable() -> str | None:
    """Why llama-server cannot be used here, or None."""
    if not BINARY.is_file():
        return f"llama-server not found at {BINARY}"
    try:
        proc = subprocess.run([str(BINARY), "--version"], capture_output=True, timeout=30)
    except OSError as exc:
        return f"llama-server cannot start here ({exc})"
    if proc.returncode != 0:
        return f"llama-server --version exited with {proc.returncode}"
    return None


@pytest.fixture(scope="module")
def llama_server():
    why = _runnable()
    if why:
        pytest.skip(why)
    from pagecli.loader.resolve import default_gguf_path

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    args = ["-m", str(default_gguf_path()), "-t", "2", "--host", "127.0.0.1"]
    args += ["--port", str(port), "-c", "4096", "-np", "4"]
    proc = subprocess.Popen([str(BINARY), *args], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.skip(f"llama-server exited with {proc.returncode}: {_tail(log.name)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"llama-server did not become ready: {_tail(log.name)}")
            time.sleep(0.2)
        yield f"{url}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.unlink(log.name)


def _tail(path: str) -> str:
    return Path(path).read_text(errors="replace")[-1500:]


def test_generate_endpoint_on_llama_server(llama_server):
    jobs = [
        {"id": 0, "prompt": "The capital of France is"},
        {"id": 1, "messages": [{"role": "user", "content": "Name a colour."}]},
        {"id": 2, "prompt_token_ids": [504, 3458, 282, 4649, 314]},
        {"id": 3, "prompt": "Once upon a time"},
        {"id": 4, "messages": [{"role": "user", "content": "What is 2 + 2?"}]},
        {"id": 5, "prompt": "def add(a, b):"},
        {"id": 6, "prompt_token_ids": [1, 2, 3, 4, 5, 6]},
        {"id": 7, "messages": [{"role": "user", "content": "Say hello."}]},
    ]
    args = ["generate", "--endpoint", llama_server, "--temperature", "0", "--max-tokens", "8"]
    proc = run([*args, "--max-concurrency", "4"], jsonl(*jobs), timeout=300)
    no_traceback(proc.stderr)
    assert proc.returncode == 0, proc.stderr.decode()
    out = records(proc.stdout)
    assert [r["id"] for r in out] == list(range(8))
    for record in out:
        assert record["error"] is None, record
        assert record["text"].strip() and record["finish_reason"] in ("length", "stop")
        assert 1 <= record["usage"]["completion_tokens"] <= 8
        assert record["usage"]["prompt_tokens"] >= 1
    # llama-server does not return token ids: null, not a made-up list.
    assert all(r["token_ids"] is None for r in out)


def test_chat_endpoint_on_llama_server(llama_server):
    proc = run(
        ["chat", "--endpoint", llama_server, "--temperature", "0", "--max-tokens", "12"],
        b"My name is Ada.\nWhat is my name?\n",
        timeout=300,
    )
    no_traceback(proc.stderr)
    assert proc.returncode == 0, proc.stderr.decode()
    replies = proc.stdout.decode().splitlines()
    assert len(replies) == 2 and all(r.strip() for r in replies)
    prompts = [int(m) for m in re.findall(r"(\d+) prompt tokens", proc.stderr.decode())]
    assert len(prompts) == 2 and prompts[1] > prompts[0]
