"""`pagecli bench --endpoint`: rows for `local` and a real `pagecli serve`, the arrival
schedule, the rate and concurrency limits, the chat and prefix scenarios, and the one-line
errors.

The command runs in-process through `main()`; the server is a real `pagecli serve`
subprocess (tests/server/conftest.py's Server), started once for the module with a small KV
cache. The timing logic is also checked on a fake Backend, without a model.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time

import pytest

from pagecli.backends.base import Backend
from pagecli.bench import report as bench_report
from pagecli.bench.scenarios import read_workload
from pagecli.bench.serving import (
    Job,
    Plan,
    arrival_offsets,
    measure,
    run_chat_sessions,
    run_jobs,
)
from pagecli.cli.app import main
from pagecli.outputs import CompletionOutput, RequestOutput, ServerReport
from tests.server.conftest import Server

SMALL = ["--num-prompts", "4", "--input-len", "8:16", "--output-len", "4:8"]
# One torch thread: beside the asyncio thread, two would oversubscribe a 2-core machine (the
# engine then waits on preempted threads, several times slower).
SMALL_ENGINE = ["--kv-cache-memory", "0.25", "--max-num-seqs", "8", "--num-threads", "1"]
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


@pytest.fixture(scope="module")
def serve():
    srv = Server(SMALL_ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def no_color(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")


def bench(capsys, *args: str, code: int = 0) -> tuple[str, str]:
    """Run `pagecli bench ARGS` in-process; (stdout, stderr), checking the exit code."""
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *args])
    out, err = capsys.readouterr()
    assert exit_info.value.code == code, err
    assert "Traceback" not in err
    return out, err


def check_latencies(row: dict) -> None:
    for key in LATENCIES:
        figures = row[key]
        assert set(figures) == {"mean", "p50", "p90", "p99"}, key
        assert 0 < figures["p50"] <= figures["p90"] <= figures["p99"], (key, figures)
    assert row["ttft_s"]["p50"] <= row["e2e_s"]["p99"]
    assert row["output_tokens_per_s"] > 0
    assert row["total_tokens_per_s"] > row["output_tokens_per_s"]


# ---- against servers -------------------------------------------------------------------


def test_local_and_serve_rows_on_one_workload(capsys, serve, tmp_path):
    saved = tmp_path / "workload.jsonl"
    out, err = bench(
        capsys,
        "--endpoint",
        "local",
        "--endpoint",
        f"serve={serve.base_url}",
        *SMALL,
        *SMALL_ENGINE,
        "--save-workload",
        str(saved),
        "--json",
    )
    report = json.loads(out)
    assert report["endpoints"] == ["local", f"serve={serve.base_url}"]
    assert report["scenario"] == "throughput" and report["request_rate"] == "inf"
    workload = read_workload(saved)
    assert len(workload) == 4
    rows = report["results"]
    assert [r["engine"] for r in rows] == ["pagecli", "serve"]
    local, remote = rows
    assert local["backend"] == "in-process"
    assert remote["backend"] == serve.base_url and remote["server"] == "pagecli"
    for row in rows:
        assert row["num_requests"] == 4
        # greedy with ignore_eos: every request makes exactly its max_tokens
        assert row["output_tokens"] == sum(n for _, n in workload)
        assert row["prompt_tokens"] == sum(len(ids) for ids, _ in workload)
        assert row["request_rate"] == "inf" and row["max_concurrency"] is None
        check_latencies(row)
    # one after another: the local row ran (and was closed) before the server's started
    assert err.index("pagecli: bench: pagecli: throughput") < err.index("serve: throughput")
    bench_report.print_report(report, json_out=False, csv_out=False)
    table = capsys.readouterr().out
    assert "pagecli bench · throughput · 2 endpoints" in table
    assert "pagecli" in table and "serve" in table and "in-process" in table
    assert "ITL p50/p99 ms" in table and "E2E p50/p99 ms" in table


def test_request_rate_and_max_concurrency(capsys, serve):
    out, _ = bench(
        capsys,
        "--endpoint",
        serve.base_url,
        *SMALL,
        "--request-rate",
        "50",
        "--max-concurrency",
        "2",
        "--json",
    )
    report = json.loads(out)
    assert report["request_rate"] == 50 and report["max_concurrency"] == 2
    (row,) = report["results"]
    assert row["engine"] == serve.base_url  # an unnamed endpoint's row is its URL
    assert row["request_rate"] == 50 and row["max_concurrency"] == 2
    assert row["num_requests"] == 4
    check_latencies(row)


def test_chat_scenario_keeps_each_session_s_replies(capsys, serve):
    out, _ = bench(
        capsys,
        "--endpoint",
        f"serve={serve.base_url}",
        "--scenario",
        "chat",
        "--sessions",
        "2",
        "--turns",
        "2",
        "--output-len",
        "4",
        "--prefix-len",
        "32",
        "--json",
    )
    (row,) = json.loads(out)["results"]
    assert row["num_requests"] == 4 and row["output_tokens"] == 16
    first, second = row["turns"]
    # turn 2 holds turn 1's messages and the assistant's reply, then the next user turn...
    assert second["prompt_tokens"] > first["prompt_tokens"] + 4
    # ...so the server's prefix cache serves at least the blocks of turn 1's prompt
    assert second["cached_tokens"] >= 16
    assert row["cached_tokens"] is not None and 0 < row["prefix_hit_rate"] < 1
    check_latencies(row)


def test_prefix_scenario_reports_cached_tokens(capsys, serve):
    out, _ = bench(
        capsys,
        "--endpoint",
        serve.base_url,
        "--scenario",
        "prefix",
        "--num-prompts",
        "3",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--prefix-len",
        "32",
        "--max-concurrency",
        "1",  # one at a time: each later request finds the shared prefix cached
        "--json",
    )
    (row,) = json.loads(out)["results"]
    assert row["num_requests"] == 3 and row["prompt_tokens"] == 3 * 36
    assert row["output_tokens"] == 6
    assert row["cached_tokens"] >= 2 * 32  # the 32-token prefix (two blocks of 16) twice
    assert row["prefix_hit_rate"] == row["cached_tokens"] / row["prompt_tokens"]


# ---- errors ----------------------------------------------------------------------------


def test_refused_endpoint_is_one_line(capsys):
    _, err = bench(capsys, "--endpoint", "http://127.0.0.1:1", *SMALL, code=2)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagecli: http://127.0.0.1:1/v1: cannot connect")


def test_refused_endpoint_fails_before_the_local_row_loads(capsys):
    _, err = bench(capsys, "--endpoint", "local", "--endpoint", "http://127.0.0.1:1", code=2)
    assert "loading" not in err and "cannot connect" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--endpoint", "http://127.0.0.1:1", "--compare", "hf"], "--compare hf"),
        (["--endpoint", "http://127.0.0.1:1", "--scenario", "latency"], "not latency"),
        (["--request-rate", "5"], "need --endpoint"),
        (["--max-concurrency", "2"], "need --endpoint"),
        (["--endpoint", "local", "--max-concurrency", "0"], "--max-concurrency must be >= 1"),
        (["--endpoint", "local", "--request-rate", "0"], "--request-rate must be > 0"),
    ],
)
def test_bad_combinations_exit_2(capsys, args, message):
    _, err = bench(capsys, *args, code=2)
    (line,) = err.strip().splitlines()
    assert line.startswith("pagecli: ") and message in line


# ---- the arrival schedule and the client-side timing, without a model ------------------


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    rate, n = 50.0, 20_000
    offsets = arrival_offsets(n, rate, random.Random(7))
    assert offsets == arrival_offsets(n, rate, random.Random(7))  # deterministic per seed
    assert offsets != arrival_offsets(n, rate, random.Random(8))
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert all(g >= 0 for g in gaps)
    # exponential gaps: mean 1/rate (standard error 0.7% here; 3% allowed), std = mean
    mean = statistics.fmean(gaps)
    assert abs(mean - 1 / rate) < 0.03 / rate
    assert 0.9 < statistics.stdev(gaps) / mean < 1.1
    assert arrival_offsets(5, math.inf, random.Random(0)) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, random.Random(0))


class FakeBackend(Backend):
    """Streams `chunks` text chunks of two tokens each: the first after `first_delay`, then one
    every `gap` seconds; counts the requests in flight."""

    name = model_name = "fake"

    def __init__(self, chunks=3, first_delay=0.05, gap=0.02, server_tokens=None) -> None:
        self.chunks, self.first_delay, self.gap = chunks, first_delay, gap
        self.server_tokens = server_tokens
        self.in_flight = self.peak = 0
        self.sent: dict[str, float] = {}
        self.prompts: dict[str, object] = {}

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def generate(self, request):
        self.sent[request.request_id] = time.perf_counter()
        self.prompts[request.request_id] = request.prompt
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.first_delay)
            text, ids = "", []
            for i in range(self.chunks):
                if i:
                    await asyncio.sleep(self.gap)
                delta = f"<{request.request_id}>" if i == 0 else "ab"
                text, ids = text + delta, ids + [7, 8]
                sample = CompletionOutput(0, text, list(ids), delta=delta)
                yield RequestOutput(request.request_id, None, [1, 2, 3], [sample])
            report = None
            if self.server_tokens is not None:
                report = ServerReport(3, self.server_tokens, 2, False, [None])
            done = CompletionOutput(0, text, list(ids), finish_reason="length")
            yield RequestOutput(
                request.request_id, None, [1, 2, 3], [done], finished=True, server=report
            )
        finally:
            self.in_flight -= 1


def test_measure_times_chunks_and_counts_tokens():
    job = Job("r", {"prompt_token_ids": [1, 2, 3, 4, 5]}, 6, prompt_tokens=5)
    sample = asyncio.run(measure(FakeBackend(), job))
    assert 0.05 <= sample.ttft < 2 and sample.ttft <= sample.e2e
    assert len(sample.itl) == 2 and all(0.019 <= g < 2 for g in sample.itl)  # per chunk
    assert sample.output_tokens == 6  # len(token_ids) without a server report
    assert sample.prompt_tokens == 5 and sample.cached_tokens == 0
    assert sample.tpot == pytest.approx((sample.e2e - sample.ttft) / 5)
    served = asyncio.run(measure(FakeBackend(server_tokens=9), Job("r", [], 6)))
    assert served.output_tokens == 9  # the server's completion_tokens win
    assert served.prompt_tokens == 3 and served.cached_tokens == 2


def test_run_jobs_keeps_the_concurrency_limit_and_the_schedule():
    jobs = [Job(f"r{i}", {"prompt_token_ids": [1]}, 2) for i in range(6)]
    limited = FakeBackend(chunks=1, first_delay=0.05)
    samples, wall = asyncio.run(run_jobs(limited, jobs, [0.0] * 6, max_concurrency=2))
    assert len(samples) == 6 and limited.peak == 2 and wall >= 3 * 0.05
    free = FakeBackend(chunks=1, first_delay=0.05)
    asyncio.run(run_jobs(free, jobs, [0.0] * 6, max_concurrency=None))
    assert free.peak == 6
    paced = FakeBackend(chunks=1, first_delay=0.0)
    asyncio.run(run_jobs(paced, jobs[:3], [0.0, 0.1, 0.2], max_concurrency=None))
    sent = [paced.sent[f"r{i}"] for i in range(3)]
    assert sent[1] - sent[0] >= 0.09 and sent[2] - sent[1] >= 0.09


def test_chat_sessions_run_turn_by_turn_keeping_their_own_replies():
    backend = FakeBackend(chunks=2, first_delay=0.0, gap=0.0)
    plan = Plan(
        "chat", math.inf, None, 0, 1000, system="SYS", chat_max_tokens=[[4, 5], [6, 7], [8, 9]]
    )
    samples, _, extra = asyncio.run(run_chat_sessions(backend, plan))
    assert len(samples) == 6 and extra["sessions"] == 2 and len(extra["turns"]) == 3
    # all of turn 1 was sent before any of turn 2
    assert max(backend.sent[f"bench-t0-s{s}"] for s in range(2)) < min(
        backend.sent[f"bench-t1-s{s}"] for s in range(2)
    )
    last = backend.prompts["bench-t2-s1"]
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["role"] for m in last] == roles
    assert last[0]["content"] == "SYS"
    # session 1's own replies (the fake answers with its request id), not session 0's
    assert last[2]["content"] == "<bench-t0-s1>ab" and last[4]["content"] == "<bench-t1-s1>ab"
    assert backend.prompts["bench-t1-s0"][2]["content"] == "<bench-t0-s0>ab"
