"""`generate --endpoint` and `chat --endpoint` against the real `pagecli serve`: the same
records as the local engine, --resume after a SIGKILL, and a piped two-turn chat."""

from __future__ import annotations

import json
import re
import signal
import time

from tests.cli.helpers import FAST, jsonl, no_traceback, records, run, start
from tests.sizes import size

GREEDY = {"temperature": 0, "max_tokens": 8}
JOBS = [
    {"id": "t1", "prompt": "The capital of France is", **GREEDY},
    {"id": "c1", "messages": [{"role": "user", "content": "Name a colour."}], **GREEDY},
    {"id": "i1", "prompt_token_ids": [504, 3458, 282, 4649, 314], **GREEDY},
    {"id": "t2", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0},
    {
        "id": "c2",
        "messages": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
        **GREEDY,
    },
    {"id": "i2", "prompt_token_ids": [1, 2, 3, 4, 5, 6, 7], "max_tokens": 5, "temperature": 0},
    {"id": "t3", "prompt": "def fibonacci(n):", **GREEDY, "stop": ["\n\n"]},
    {"id": "n2", "prompt": "Roses are red,", "n": 2, **GREEDY},
    {
        "custom_id": "b1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Say hi."}], **GREEDY},
    },
]


def _comparable(record: dict) -> dict:
    """A record without what depends on the cache's history (cached_tokens) or on the run
    (the batch API's ids, timestamps and model name)."""
    record = json.loads(json.dumps(record))
    if "custom_id" in record:
        body = record["response"]["body"]
        return {
            "custom_id": record["custom_id"],
            "choices": body["choices"],
            "tokens": (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]),
        }
    record["usage"].pop("cached_tokens")
    return record


def test_generate_endpoint_gives_the_local_records(server):
    stdin = jsonl(*JOBS)
    local = run(["generate", *FAST], stdin)
    remote = run(
        ["generate", "--endpoint", server.base_url, "--max-concurrency", "8"], stdin, timeout=300
    )
    no_traceback(remote.stderr)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr.decode()
    ours, theirs = records(local.stdout), records(remote.stdout)
    assert [r.get("custom_id", r.get("id")) for r in theirs] == [
        j.get("custom_id", j.get("id")) for j in JOBS
    ]
    assert all(r.get("error") is None for r in theirs)
    assert [_comparable(r) for r in theirs] == [_comparable(r) for r in ours]
    # pagecli serve returns token ids (return_token_ids) and its cache counts.
    assert all(isinstance(r["usage"]["cached_tokens"], int) for r in theirs if "usage" in r)
    assert theirs[0]["token_ids"] and len(theirs[0]["token_ids"]) == 8


def test_resume_after_sigkill_answers_every_id_once(server, tmp_path):
    jobs = [
        {"id": i, "prompt": f"Write a sentence about the number {i}.", "max_tokens": 24}
        for i in range(size(20, 40))
    ]
    out = tmp_path / "out.jsonl"
    args = ["generate", "--endpoint", server.base_url, "--max-concurrency", "4", "-o", str(out)]
    proc = start(args)
    proc.stdin.write(jsonl(*jobs))
    proc.stdin.close()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    first = out.read_bytes().count(b"\n")
    assert 5 <= first < len(jobs), "the kill came too late to test anything"
    resumed = run([*args, "--resume"], jsonl(*jobs), timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()
    ids = []
    for line in out.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line the kill cut short: kept, answers no id
            continue
        if record.get("error") is None:
            ids.append(record["id"])
    assert sorted(ids) == list(range(len(jobs)))


STATS = re.compile(r"(\d+) prompt tokens(?: · (\d+) cached)? · TTFT [\d.]+ s · (\d+) tokens")


def test_chat_endpoint_piped_two_turns(server):
    proc = run(
        ["chat", "--endpoint", server.base_url, "--temperature", "0", "--max-tokens", "12"],
        b"My name is Ada and I like tea.\nWhat is my name?\n/blocks\n",
        timeout=300,
    )
    no_traceback(proc.stderr)
    err = proc.stderr.decode()
    replies = proc.stdout.decode().splitlines()
    assert len(replies) == 2 and all(r.strip() for r in replies), proc.stdout
    turns = [tuple(int(g) if g else None for g in m.groups()) for m in STATS.finditer(err)]
    assert len(turns) == 2, err
    (prompt1, _, gen1), (prompt2, cached2, _) = turns
    assert 1 <= gen1 <= 12
    # The second prompt holds the first turn (so more tokens), and the server's prefix
    # cache served at least the full blocks of the first prompt's shared part.
    assert prompt2 > prompt1 + gen1
    assert cached2 is not None and cached2 >= 16
    # /blocks needs the local engine: one error line, and the exit code says so.
    assert "not available with --endpoint" in err
    assert proc.returncode == 1
