"""`pagecli serve` on the default model, driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest
import torch

from tests.cli.helpers import jsonl, records, run
from tests.server.conftest import SEED_MODEL
from tests.sizes import size

SEED_SNIPPET = """
from openai import OpenAI
client = OpenAI(base_url="http://localhost:8000/v1", api_key="dummy")
stream = client.chat.completions.create(
    model="meta-llama/Llama-2-7b-hf",
    messages=[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": "解释 PagedAttention 的核心原理"}],
    max_tokens=512, temperature=0.7, stream=True)
for chunk in stream:
    if chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
"""


def seed_snippet(base_url: str) -> str:
    """The snippet pointed at `base_url`; its 512-token reply cut to 64 at the CI size."""
    code = SEED_SNIPPET.replace("http://localhost:8000/v1", base_url)
    assert code != SEED_SNIPPET
    return code.replace("max_tokens=512", f"max_tokens={size(64, 512)}")


def test_seed_snippet_streams_text(server):
    code = seed_snippet(server.base_url)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip(), "the snippet printed no text"
    assert b"Traceback" not in done.stderr


def test_greedy_outputs_equal_generate(server):
    text_records = [
        {"id": "t1", "prompt": "The capital of France is"},
        {"id": "t2", "prompt": "def fibonacci(n):"},
    ]
    chat_records = [
        {"id": "c1", "messages": [{"role": "user", "content": "Name three colors."}]},
        {
            "id": "c2",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 2 + 2?"},
            ],
        },
    ]
    done = run(
        ["generate", "--temperature", "0", "--max-tokens", "24", "--kv-cache-memory", "0.25"],
        jsonl(*text_records, *chat_records),
    )
    assert done.returncode == 0, done.stderr.decode()
    expected = {r["id"]: r["text"] for r in records(done.stdout)}
    client = server.client()
    for rec in text_records:
        got = client.completions.create(
            model=SEED_MODEL, prompt=rec["prompt"], max_tokens=24, temperature=0
        )
        assert got.choices[0].text == expected[rec["id"]], rec["id"]
    for rec in chat_records:
        got = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=rec["messages"], max_tokens=24, temperature=0
        )
        assert got.choices[0].message.content == expected[rec["id"]], rec["id"]


async def _stream_text(client, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(
        model=SEED_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    parts = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    return "".join(parts)


def test_concurrent_streams_get_what_they_get_alone(server):
    prompts = [f"Item {i}: a short fact about the number {i * 7} is" for i in range(32)]

    async def alone() -> list[str]:
        async with server.async_client() as client:
            return [await _stream_text(client, p, 8) for p in prompts]

    async def together() -> tuple[list[str], float]:
        seen_running = [0.0]
        stop = asyncio.Event()

        async def watch() -> None:
            async with httpx.AsyncClient(timeout=120) as http:
                while not stop.is_set():
                    text = (await http.get(f"{server.url}/metrics")).text
                    for line in text.splitlines():
                        if line.startswith("pagecli:num_requests_running{"):
                            seen_running[0] = max(seen_running[0], float(line.split()[-1]))
                    await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch())
        async with server.async_client() as client:
            texts = await asyncio.gather(*(_stream_text(client, p, 8) for p in prompts))
        stop.set()
        await watcher
        return list(texts), seen_running[0]

    single = asyncio.run(alone())
    batched, most_running = asyncio.run(together())
    assert all(single), "an empty reply"
    mismatched = [i for i, (a, b) in enumerate(zip(single, batched)) if a != b]
    assert not mismatched, [(single[i], batched[i]) for i in mismatched]
    assert most_running > 1, "/metrics never showed more than one request running"


def _wait_idle(server, within_s: float = 1.0) -> float:
    """Seconds until /metrics shows nothing running and no block in use; fails past the
    limit."""
    start = time.monotonic()
    while True:
        m = server.metrics()
        if m["pagecli:num_requests_running"] == 0 and m["pagecli:kv_cache_blocks_in_use"] == 0:
            return time.monotonic() - start
        assert time.monotonic() - start < within_s, f"still busy after {within_s} s: {m}"
        time.sleep(0.05)


def _wait_running(server, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metrics()["pagecli:num_requests_running"] < 1:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.05)


def test_a_stream_closed_after_a_few_chunks_is_aborted(server):
    client = server.client()
    stream = client.completions.create(
        model=SEED_MODEL,
        prompt="Count: one, two, three,",
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _wait_idle(server)
    reply = client.completions.create(model=SEED_MODEL, prompt="Hello", max_tokens=2)
    assert reply.choices[0].text
    assert "Traceback" not in server.stderr()


def test_a_non_streaming_request_that_times_out_is_aborted(server):
    from openai import APITimeoutError

    client = server.client(timeout=1.5)
    with pytest.raises(APITimeoutError):
        client.completions.create(
            model=SEED_MODEL,
            prompt="Count: one, two, three,",
            max_tokens=4000,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    _wait_idle(server)
    reply = server.client().completions.create(model=SEED_MODEL, prompt="Hi", max_tokens=2)
    assert reply.choices[0].text
    assert "POST /v1/completions 499" in server.stderr()  # the timed-out one, in the log
    assert "Traceback" not in server.stderr()


def test_include_usage_yields_the_usage_chunk(server):
    stream = server.client().chat.completions.create(
        model=SEED_MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens > 0 and 0 < last.usage.completion_tokens <= 6
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_shared_system_prompt_is_served_from_the_cache(server):
    system = "You are a meticulous assistant. " + " ".join(
        f"Rule {i}: answer with care and cite the rule number." for i in range(12)
    )
    client = server.client()

    def ask(question: str):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model=SEED_MODEL, messages=messages, max_tokens=2, temperature=0
        )
        ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
        return reply, ids

    _, first_ids = ask("What is rule 3?")
    second, second_ids = ask("And what does rule 7 say?")
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert common >= 160, "the system prompt should span many blocks"
    assert second.usage.prompt_tokens == len(second_ids)
    assert second.usage.prompt_tokens_details.cached_tokens >= common // 16 * 16


def test_n_stop_and_seed(server):
    client = server.client()
    messages = [{"role": "user", "content": "Write a sentence about cats."}]
    kw = dict(model=SEED_MODEL, messages=messages, max_tokens=16, temperature=0.9)
    two = client.chat.completions.create(n=2, seed=7, **kw)
    assert sorted(c.index for c in two.choices) == [0, 1]
    again = client.chat.completions.create(n=2, seed=7, **kw)
    assert [c.message.content for c in two.choices] == [c.message.content for c in again.choices]
    assert 2 <= two.usage.completion_tokens <= 32
    greedy = client.chat.completions.create(
        model=SEED_MODEL, messages=messages, max_tokens=16, temperature=0
    )
    text = greedy.choices[0].message.content
    words = text.split()
    assert len(words) > 3, text
    stop = words[2]
    cut = client.chat.completions.create(
        model=SEED_MODEL, messages=messages, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_top_logprobs_equal_transformers_log_softmax(server, hf_default_model):
    prompt_ids = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "The three primary colors are"}
    ).json()["tokens"]
    reply = server.client().completions.create(
        model=SEED_MODEL,
        prompt=prompt_ids,
        max_tokens=8,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True},
    )
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == reply.usage.completion_tokens == 8
    chat = server.client().chat.completions.create(
        model=SEED_MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)

    gen_ids = reply.choices[0].model_extra["token_ids"]
    assert reply.choices[0].model_extra["prompt_token_ids"] == prompt_ids
    ids = torch.tensor([prompt_ids + gen_ids])
    with torch.no_grad():
        logits = hf_default_model(ids).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)  # [T, V]
    n = len(prompt_ids)
    assert len(gen_ids) == 8
    for k, (token_lp, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs)):
        row = ref[n - 1 + k]
        assert abs(token_lp - row[gen_ids[k]].item()) < 1e-4
        values, _ = row.topk(3)
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-4)
        assert gen_ids[k] == row.argmax().item() or row.topk(2).values.diff().abs() < 1e-4


def test_tokenize_detokenize_models_version(server):
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert "Hello world" in back["prompt"]
    models = server.client().models.list()
    assert {m.id for m in models.data} == {"SmolLM2-135M-Instruct", SEED_MODEL}
    assert httpx.get(f"{server.url}/version").json()["version"]


def _settled_count(server, text: str) -> int:
    """How often `text` is in the server's stderr once it stops changing (an access line is
    written just after its response, so the previous test's may still be on its way)."""
    count = server.stderr().count(text)
    while True:
        time.sleep(0.3)
        now = server.stderr().count(text)
        if now == count:
            return count
        count = now


def test_stderr_has_one_access_line_per_request(server):
    before = _settled_count(server, "GET /version 200")
    httpx.get(f"{server.url}/version")
    assert _settled_count(server, "GET /version 200") == before + 1
    reply = server.client().completions.create(
        model=SEED_MODEL, prompt="Hi", max_tokens=3, temperature=0
    )
    time.sleep(0.3)
    line = [x for x in server.stderr().splitlines() if x.startswith("POST /v1/completions")][-1]
    fields = line.split()
    assert fields[2] == "200"
    assert f"prompt={reply.usage.prompt_tokens}" in fields
    assert f"completion={reply.usage.completion_tokens}" in fields
    assert fields[-1].endswith("s") and "cached=" in line


def test_stats_is_the_engine_snapshot_with_the_kernel_settings(server):
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["num_blocks"] > 0 and stats["num_running"] == 0 and "block_states" not in stats
    assert stats["kernels"]["isa"] in ("portable", "avx2", "avx512")


def test_prometheus_names(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_cache_cached_free_blocks",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
    ):
        assert f"pagecli:{name}" in text, name
    assert 'mode="recompute"' in text and 'mode="swap"' in text
