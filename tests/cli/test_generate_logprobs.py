"""`logprobs: K` in a generate record: each generated token's log-probability and the K most
likely tokens, in the output record."""

from __future__ import annotations

import math

from tests.cli.helpers import FAST, jsonl, records, run


def test_a_record_asks_for_logprobs():
    done = run(
        ["generate", *FAST],
        jsonl(
            {"id": "a", "prompt": "The capital of France is", "logprobs": 2},
            {"id": "b", "prompt": "Hello"},
            {"id": "c", "prompt": "Hi", "logprobs": 99},
        ),
    )
    assert done.returncode == 0, done.stderr.decode()
    a, b, c = records(done.stdout)
    assert len(a["logprobs"]) == len(a["token_ids"]) == 6
    for token_id, entry in zip(a["token_ids"], a["logprobs"]):
        assert entry["token_id"] == token_id
        assert len(entry["top"]) == 2
        assert entry["top"][0]["logprob"] >= entry["top"][1]["logprob"]
        # greedy: the chosen token is the most likely one
        assert math.isclose(entry["logprob"], entry["top"][0]["logprob"], abs_tol=1e-6)
        assert entry["logprob"] <= 0
    assert "logprobs" not in b
    assert c["finish_reason"] == "error" and "logprobs" in c["error"]["message"]
