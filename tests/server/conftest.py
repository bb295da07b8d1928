"""`pagecli serve` as a real subprocess on a free port, waited for through /health."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.cli.helpers import PAGECLI, env

START_TIMEOUT_S = 240  # a loaded 2-core machine can take a while to start the engine
# The default model under two names: its own, and the seed snippet's.
SEED_MODEL = "meta-llama/Llama-2-7b-hf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `pagecli serve`; stderr goes to a file (it carries one line per request)."""

    def __init__(
        self, args: list[str], extra_env: dict[str, str] | None = None, wait: bool = True
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self._stderr = tempfile.NamedTemporaryFile(
            prefix="pagecli-serve-", suffix=".err", delete=False
        )
        self.proc = subprocess.Popen(
            [*PAGECLI, "serve", "--port", str(self.port), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**env(), **(extra_env or {})},
        )
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"pagecli serve exited with {self.proc.returncode}: {self.stderr()[-2000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"pagecli serve did not become healthy: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        return Path(self._stderr.name).read_text(errors="replace")

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(
            base_url=self.base_url, api_key=kw.pop("api_key", "dummy"), max_retries=0, **kw
        )

    def async_client(self, **kw):
        from openai import AsyncOpenAI

        return AsyncOpenAI(
            base_url=self.base_url, api_key=kw.pop("api_key", "dummy"), max_retries=0, **kw
        )

    def metrics(self) -> dict[str, float]:
        """The unlabelled-by-mode `pagecli:` samples of /metrics, by name."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("pagecli:") and "_bucket" not in line:
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{", 1)[0]
                if 'mode="' in name_labels:
                    name += "{" + name_labels.split('mode="', 1)[1].split('"', 1)[0] + "}"
                values[name] = float(value)
        return values

    def stop(self, sig: int | None = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server (`sig` None: it was signalled already) and wait for its exit."""
        if sig is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()
            os.unlink(self._stderr.name)


@pytest.fixture(scope="session")
def server():
    """The default model, served as itself and under the seed snippet's name."""
    srv = Server(
        [
            "--served-model-name",
            "SmolLM2-135M-Instruct",
            "--served-model-name",
            SEED_MODEL,
            "--kv-cache-memory",
            "0.5",
        ]
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_server_args(tiny_models) -> list[str]:
    """A tiny random-weight model with no tokenizer: fast to start, token-id prompts only."""
    return ["--model", str(tiny_models["llama3"]), "--num-kv-blocks", "64", "--block-size", "4"]


def streamed_chat(client, **kwargs) -> tuple[str, list[dict], list[str]]:
    """A streamed chat completion put back together: its content, its tool calls ({id, name,
    arguments} by index, arguments joined from their deltas) and its finish reasons."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] += d.function.name or ""
            entry["arguments"] += d.function.arguments or ""
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return content, [calls[i] for i in sorted(calls)], finish
