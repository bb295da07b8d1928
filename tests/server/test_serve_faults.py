"""Errors, limits, keys and shutdown of `pagecli serve`: every error answers with its status
and the OpenAI envelope, and the server keeps serving after each."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest

from tests.server.conftest import SEED_MODEL, Server


def _envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    return error


def _still_serves(url: str, model: str | None = SEED_MODEL, prompt=None) -> None:
    body = {"prompt": prompt or "Hi", "max_tokens": 2}
    if model:
        body["model"] = model
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"messages": "hello"}', 400, "messages"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
            400,
            "temperature",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 7}', 400, "top_p"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', 400, "n"),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
            400,
            "messages",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
            400,
            "tools[0].function",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"1": 5}}',
            400,
            "logit_bias",
        ),
        (
            b'{"messages": [{"role": "user", "content": "hi"}], "response_format": '
            b'{"type": "yaml"}}',
            400,
            "response_format.type",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}', 404, "model"),
    ],
)
def test_bad_requests_get_the_envelope(server, body, status, param):
    response = httpx.post(
        f"{server.url}{CHAT}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    error = _envelope(response, status)
    assert error["param"] == param
    _still_serves(server.url)


def test_too_long_prompt_and_unknown_route(server):
    long_prompt = "word " * 9000
    error = _envelope(
        httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": long_prompt, "max_tokens": 4},
            timeout=60,
        ),
        400,
    )
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "8192 tokens" in error["message"]
    # 6 MB of text, under the body limit: refused from a prefix, so in seconds.
    start = time.monotonic()
    huge = httpx.post(
        f"{server.url}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "a " * 3_000_000}]},
    )
    assert _envelope(huge, 400)["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 5
    error = _envelope(
        httpx.post(
            f"{server.url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 8192}
        ),
        400,
    )
    assert "exceeds" in error["message"] and error["code"] == "context_length_exceeded"
    _envelope(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    _still_serves(server.url)


def test_unknown_fields_are_ignored_with_a_warning(server):
    reply = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "frobnicate": True},
        timeout=60,
    )
    assert reply.status_code == 200
    time.sleep(0.2)
    assert "ignoring unknown request field(s): frobnicate" in server.stderr()


def test_openai_client_sees_the_errors(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=SEED_MODEL, temperature=-3, messages=[{"role": "user", "content": "x"}]
        )


@pytest.fixture(scope="module")
def guarded(tiny_server_args):
    """The tiny model behind an API key, a 2 KB body limit and a one-request queue."""
    srv = Server(
        [
            *tiny_server_args,
            "--max-request-bytes",
            "2048",
            "--max-queued-requests",
            "1",
            "--max-num-seqs",
            "1",
        ],
        extra_env={"PAGECLI_API_KEY": "sekrit"},
    )
    yield srv
    srv.stop()


def _tiny(url: str, key: str | None = "sekrit", **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    payload = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, headers=headers, timeout=60)


def test_api_key_from_the_environment(guarded):
    assert _envelope(_tiny(guarded.url, key=None), 401)["code"] == "invalid_api_key"
    _envelope(_tiny(guarded.url, key="wrong"), 401)
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200
    _envelope(httpx.get(f"{guarded.url}/v1/models"), 401)
    assert _tiny(guarded.url).status_code == 200
    client = guarded.client(api_key="sekrit")
    assert client.completions.create(
        model=client.models.list().data[0].id, prompt=[5, 6], max_tokens=2
    ).choices


def test_a_body_over_the_limit_is_413(guarded):
    error = _envelope(_tiny(guarded.url, prompt=list(range(1, 300)) * 3), 413)
    assert error["code"] == "request_too_large"
    chunked = httpx.post(
        f"{guarded.url}/v1/completions",
        content=iter([b'{"prompt": [', b"1, " * 1500, b"1]}"]),
        headers={"authorization": "Bearer sekrit", "content-type": "application/json"},
        timeout=60,
    )
    _envelope(chunked, 413)
    assert _tiny(guarded.url).status_code == 200


def test_a_full_queue_is_503_with_retry_after(guarded):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            payload = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(
                *(
                    http.post(
                        f"{guarded.url}/v1/completions",
                        json=payload,
                        headers={"authorization": "Bearer sekrit"},
                    )
                    for _ in range(8)
                )
            )

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert 200 in statuses and 503 in statuses, statuses
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["retry-after"] == "1"
    assert _envelope(refused, 503)["code"] == "queue_full"
    assert _tiny(guarded.url).status_code == 200


def test_sigterm_during_a_stream_exits_0_without_traceback(tiny_server_args):
    srv = Server([*tiny_server_args, "--shutdown-timeout", "2"])
    client = srv.client()
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=[1, 2, 3],
        max_tokens=250,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    iterator = iter(stream)
    next(iterator)
    start = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    received = sum(1 for _ in _until_broken(iterator))
    code = srv.proc.wait(30)
    took = time.monotonic() - start
    stderr, stdout = srv.stderr(), srv.proc.stdout.read()
    srv.stop()
    assert code == 0, stderr
    assert took < 2 + 8, f"took {took:.1f} s to stop"
    assert received >= 0
    assert "Traceback" not in stderr, stderr
    assert stdout == b"", "stdout must stay empty"


def _until_broken(iterator):
    try:
        yield from iterator
    except (httpx.HTTPError, openai.APIError):
        return


def test_a_model_that_cannot_load_ends_in_one_line(tmp_path):
    srv = Server(["--model", str(tmp_path / "missing")], wait=False)
    code = srv.proc.wait(120)
    stderr = srv.stderr()
    srv.stop()
    assert code == 2, stderr
    lines = [x for x in stderr.splitlines() if x.startswith("pagecli: ") and "missing" in x]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr


def test_a_taken_port_is_one_line():
    import socket
    import subprocess

    from tests.cli.helpers import PAGECLI, env

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*PAGECLI, "serve", "--port", str(port)], capture_output=True, timeout=120, env=env()
        )
    assert done.returncode == 2
    assert done.stderr.decode().strip().startswith(f"pagecli: cannot listen on 127.0.0.1:{port}")
    assert done.stdout == b""


def test_on_a_terminal_stderr_shows_the_block_display(tiny_server_args):
    import os
    import pty
    import select
    import subprocess

    from tests.cli.helpers import PAGECLI, env
    from tests.server.conftest import free_port

    port = free_port()
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*PAGECLI, "serve", "--port", str(port), *tiny_server_args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        env={**env(), "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"},
    )
    os.close(follower)
    screen = b""

    def read(seconds: float) -> None:
        nonlocal screen
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    screen += os.read(leader, 65536)
                except OSError:
                    return

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while b"Ctrl-C stops" not in screen:
        assert time.monotonic() < deadline and proc.poll() is None, screen[-2000:]
        read(0.5)
    reply = httpx.post(
        f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 20}, timeout=60
    )
    assert reply.status_code == 200
    read(1.5)
    proc.send_signal(signal.SIGINT)
    read(3)
    code = proc.wait(30)
    os.close(leader)
    text = screen.decode(errors="replace")
    assert code == 0, text[-2000:]
    assert "blocks in use" in text and "requests in flight" in text
    assert "POST /v1/completions" not in text  # no access lines under the display
    assert proc.stdout.read() == b""
