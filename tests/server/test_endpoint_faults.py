"""`--endpoint` against a server that fails on purpose (tests/server/fault_server.py):
retries with backoff and Retry-After, no retry of a 400, dropped connections, and the one
line a bad URL, a refused connection or a refused key ends in."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
import time

import pytest

from pagecli.backends.base import Request, RequestRejected
from pagecli.backends.remote import RemoteBackend, base_url
from pagecli.backends.retry import RetryPolicy, is_retryable_status, parse_retry_after
from pagecli.backends.sync import SyncBackend
from pagecli.sampling_params import SamplingParams
from tests.cli.helpers import jsonl, no_traceback, records, run, start
from tests.server.fault_server import RETRY_AFTER_S, SLOW_S, FaultServer


@pytest.fixture(scope="module")
def faults():
    server = FaultServer()
    yield server
    server.stop()


def attempts(faults, prompt) -> list[float]:
    return faults.app.attempts[json.dumps(prompt)]


def test_retries_then_errors_as_records_and_the_rest_goes_on(faults):
    stdin = jsonl(
        {"id": "a", "prompt": "hello"},
        {"id": "flaky", "prompt": "flaky one"},
        {"id": "bad", "prompt": "bad one"},
        {"id": "cut", "prompt": "cut one"},
        {"id": "chat", "messages": [{"role": "user", "content": "hi there"}]},
        {"id": "deny", "prompt": "deny me"},
        {"id": "throttle", "prompt": "throttle me"},
        {"id": "malformed", "prompt": "malformed me"},
        {"id": "z", "prompt": "last"},
    )
    proc = run(["generate", "--endpoint", faults.url, "--max-retries", "2"], stdin)
    no_traceback(proc.stderr)
    assert proc.returncode == 0, proc.stderr.decode()
    out = {r["id"]: r for r in records(proc.stdout)}
    assert [r["id"] for r in records(proc.stdout)] == [
        "a",
        "flaky",
        "bad",
        "cut",
        "chat",
        "deny",
        "throttle",
        "malformed",
        "z",
    ]

    # 503 twice, then 200: the record succeeds after two retries, each Retry-After seconds
    # later (the backoff alone would wait under 0.5 s, then under 1 s).
    flaky = attempts(faults, "flaky one")
    assert len(flaky) == 3
    assert out["flaky"]["error"] is None and out["flaky"]["text"] == " echo: flaky one"
    gaps = [b - a for a, b in zip(flaky, flaky[1:])]
    assert all(gap >= RETRY_AFTER_S - 0.05 for gap in gaps), gaps

    # A 400 is final: one attempt, an error record with the server's status and message.
    assert len(attempts(faults, "bad one")) == 1
    assert out["bad"]["error"]["status"] == 400
    assert "max_tokens is too large" in out["bad"]["error"]["message"]
    assert out["bad"]["finish_reason"] == "error"

    # A connection dropped mid-body: retried (1 + --max-retries attempts), then an error.
    assert len(attempts(faults, "cut one")) == 3
    assert out["cut"]["finish_reason"] == "error"
    assert "connection failed" in out["cut"]["error"]["message"]
    assert "after 3 tries" in out["cut"]["error"]["message"]

    # A 401 mid-run is final too; a 429 is retried; an answer of the wrong shape is an error
    # record, not a crash.
    assert len(attempts(faults, "deny me")) == 1 and out["deny"]["error"]["status"] == 401
    assert len(attempts(faults, "throttle me")) == 2 and out["throttle"]["error"] is None
    assert out["malformed"]["finish_reason"] == "error"
    assert "not an object" in out["malformed"]["error"]["message"]

    # The others are answered; what the server did not report stays null.
    for key, text in (("a", "hello"), ("chat", "hi there"), ("z", "last")):
        assert out[key]["text"] == f" echo: {text}"
        assert out[key]["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": None,
        }
        assert out[key]["token_ids"] is None


def test_fail_fast_stops_at_the_first_error_record(faults):
    stdin = jsonl(
        {"id": 1, "prompt": "bad again"}, *({"id": i, "prompt": f"p{i}"} for i in range(2, 40))
    )
    proc = run(
        ["generate", "--endpoint", faults.url, "--fail-fast", "--max-concurrency", "1"], stdin
    )
    no_traceback(proc.stderr)
    assert proc.returncode == 1
    out = records(proc.stdout)
    # One at a time: the error record is the first answer, and the run stops there.
    assert len(out) == 1 and out[0]["id"] == 1 and out[0]["error"]["status"] == 400


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://127.0.0.1:1/v1", "cannot connect"),
        ("not a url", "not an http(s) URL"),
        ("ftp://example.com/v1", "not an http(s) URL"),
    ],
)
def test_a_bad_or_refused_endpoint_is_one_line_and_exit_2(url, words):
    proc = run(["generate", "--endpoint", url], jsonl({"id": 1, "prompt": "hi"}))
    assert proc.returncode == 2
    assert proc.stdout == b""
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagecli: ") and words in lines[0], lines


def test_a_refused_key_is_one_line_before_any_record_is_read(faults):
    locked = faults.url.replace("/v1", "/locked/v1")
    for command in (["generate"], ["chat"]):
        proc = run([*command, "--endpoint", locked, "--api-key", "wrong"], b"")
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.decode().strip()
        assert "\n" not in line and "401" in line and "bad key" in line
        assert proc.stdout == b""
    proc = run(
        ["generate", "--endpoint", locked, "--api-key", "good"], jsonl({"id": 1, "prompt": "k"})
    )
    assert proc.returncode == 0 and records(proc.stdout)[0]["text"] == " echo: k"


def test_chat_streams_survive_a_drop_before_the_first_chunk_not_after(faults):
    async def main():
        backend = RemoteBackend(
            faults.url, retry_policy=RetryPolicy(max_retries=2, base_delay=0.01)
        )
        await backend.start()
        try:
            params = SamplingParams(max_tokens=4)
            prompt = [{"role": "user", "content": "dropfirst please"}]
            outs = [o async for o in backend.generate(Request("r1", prompt, params, stream=True))]
            assert outs[-1].finished and outs[-1].text == " echo: dropfirst please"
            assert [o.delta for o in outs[:-1]] == [" echo:", " dropfirst please"]
            assert outs[-1].server.completion_tokens == 2
            assert len(attempts(faults, "dropfirst please")) == 2
            seen = []
            with pytest.raises(RequestRejected, match="mid-stream"):
                prompt = [{"role": "user", "content": "cut stream"}]
                async for o in backend.generate(Request("r2", prompt, params, stream=True)):
                    seen.append(o.delta)
            assert seen == ["half"]  # handed on, so not retried
            assert len(attempts(faults, "cut stream")) == 1
        finally:
            await backend.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_keeps_the_finished_records_and_aborts_the_rest(faults, sig, code):
    proc = start(["generate", "--endpoint", faults.url, "--max-concurrency", "4"])
    slow = f"slow {sig.name}"  # a prompt of its own: the attempts are counted by prompt
    proc.stdin.write(jsonl({"id": 1, "prompt": "quick"}, {"id": 2, "prompt": slow}))
    proc.stdin.flush()  # stdin stays open: the run is waiting for the slow answer
    deadline = time.monotonic() + 60
    while not attempts(faults, slow) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    began = time.monotonic()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - began < SLOW_S / 2  # it did not wait for the slow answer
    assert proc.returncode == code
    no_traceback(err)
    assert [r["id"] for r in records(out)] == [1]  # the finished one, whole


def test_a_stopped_chat_turn_does_not_wait_for_a_silent_server(faults):
    backend = SyncBackend(RemoteBackend(faults.url))
    backend.start()
    try:
        asked = {"stop": False}
        with backend.stoppable(lambda: asked["stop"]):
            stream = backend.stream([{"role": "user", "content": "slow chat"}])
            began = time.monotonic()
            threading.Timer(0.5, asked.update, kwargs={"stop": True}).start()
            assert list(stream) == []  # nothing arrived; the stop ended the wait
            assert time.monotonic() - began < 5
    finally:
        backend.close()


def test_retry_rules():
    assert [
        s for s in (400, 401, 404, 408, 413, 422, 429, 500, 502, 503) if is_retryable_status(s)
    ] == [
        408,
        429,
        500,
        502,
        503,
    ]
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    policy, rng = RetryPolicy(base_delay=0.5, max_delay=4.0), random.Random(0)
    for attempt in range(8):
        cap = min(4.0, 0.5 * 2**attempt)
        draws = [policy.delay(attempt, None, rng) for _ in range(200)]
        assert all(0 <= d <= cap for d in draws) and max(draws) > 0.8 * cap  # jittered, capped
    assert policy.delay(5, 7.5, rng) == 7.5


def test_base_url():
    assert base_url("http://h:8000") == "http://h:8000/v1"
    assert base_url("http://h:8000/") == "http://h:8000/v1"
    assert base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert base_url("https://api.example.com/openai/v1") == "https://api.example.com/openai/v1"
