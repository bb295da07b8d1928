"""`pagecli serve --speculative-config`: the same greedy replies as a server without it, and
vLLM's spec_decode counters in /metrics, the acceptance in /stats."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import Server

PROMPT = (
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog, and the "
    "lazy dog sleeps."
)


@pytest.fixture(scope="module")
def spec_server():
    srv = Server(
        [
            "--served-model-name",
            "SmolLM2-135M-Instruct",
            "--kv-cache-memory",
            "0.5",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 4}',
        ]
    )
    yield srv
    srv.stop()


def test_greedy_replies_equal_and_counters_count(spec_server, server):
    def ask(srv, stream: bool) -> str:
        client = srv.client()
        kwargs = dict(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": PROMPT}],
            temperature=0,
            max_tokens=48,
        )
        if not stream:
            return client.chat.completions.create(**kwargs).choices[0].message.content
        chunks = client.chat.completions.create(stream=True, **kwargs)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    for stream in (False, True):
        assert ask(spec_server, stream) == ask(server, stream)
    metrics = spec_server.metrics()
    assert metrics["pagecli:spec_decode_num_drafts_total"] > 0
    accepted = metrics["pagecli:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= metrics["pagecli:spec_decode_num_draft_tokens_total"]
    text = httpx.get(f"{spec_server.url}/metrics", timeout=10).text
    assert (
        'spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",position="0"}'
        in text
    )
    stats = httpx.get(f"{spec_server.url}/stats").json()
    assert 0 < stats["spec_acceptance_rate"] <= 1 and stats["spec_mean_accepted_length"] > 1
