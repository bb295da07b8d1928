"""`pagecli bench --endpoint URL ...`: the throughput, prefix and chat scenarios against
servers, one row per `--endpoint`, measured on the client side as `vllm bench serve` does.

The driver is written once against `Backend` (pagecli.backends): an OpenAI-compatible server
(`pagecli serve`, vLLM, llama.cpp's llama-server, ...) and this process's own engine
(`--endpoint local`) run exactly the same code. Backends run one after another: each is
started, warmed up with a burst of small requests, measured and closed before the next one
starts, so at most one in-process engine exists at a time.

The workload is the in-process one (`draw_workload`: random token ids, greedy, ignore_eos,
max_tokens per request), sent as token ids to /v1/completions, so every row does the same
work. Random ids need a vocabulary size before the first row runs and must be the same for
every row: it is read from the config.json of `--model` (the default model unless given;
no weights are loaded). That is also the model a `local` row loads, so its vocabulary is
the local engine's `hf_config.vocab_size`. For a server that runs another model, pass its
`--model` (or one whose vocabulary is no larger). The chat scenario sizes its system prompt
with the tokenizer of the same `--model`.

Requests arrive as a Poisson process at `--request-rate` (exponential gaps of mean 1/R, from
a seeded RNG; `inf` sends them all at once) with at most `--max-concurrency` in flight.

What each request measures, from its streamed outputs (client side, `time.perf_counter`):

- TTFT: the first output that carries text, minus the time the request was sent (after it
  got a place under --max-concurrency);
- ITL: the gaps between successive outputs that carry text. These are per chunk, not per
  token: a server (or the local engine's detokenizer) may put several tokens in one chunk,
  and then the ITL of that chunk spans all of them;
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- E2E: the finished output minus the send time;
- output tokens: the server's `usage.completion_tokens` (`output.server`) for a remote
  server, `len(output.token_ids)` for the local engine;
- cached tokens: the server's `usage.prompt_tokens_details.cached_tokens`, summed over the
  requests (None in the row when the server does not report it), or the local engine's own
  count; "prefix hits" (prefix and chat scenarios) is cached over prompt tokens.

Throughput is output (and prompt plus output) tokens over the wall time from the first send
to the last finished request.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pagecli import __version__
from pagecli.backends.base import Backend, Prompt
from pagecli.backends.base import Request as BackendRequest
from pagecli.bench.report import machine, note
from pagecli.bench.scenarios import (
    USER_TURNS,
    Range,
    draw_workload,
    params,
    random_ids,
    rates,
    summary,
    system_prompt,
    write_workload,
)
from pagecli.cli.endpoint import EndpointSettings, start_error
from pagecli.cli.options import CliError, load_error
from pagecli.config import EngineConfig
from pagecli.errors import BackendError, RequestRejected

SCENARIOS = ("throughput", "prefix", "chat")
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 4
WARMUP_REQUESTS = 16
WARMUP_MAX_PROMPT_TOKENS = 512


# ---- arrivals --------------------------------------------------------------------------


def arrival_offsets(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """When each request is sent, in seconds after the start: a Poisson process at `rate`
    requests/s (the first at 0, then exponential gaps of mean 1/rate), or all at 0 when
    `rate` is inf, as `vllm bench serve` sends them."""
    if not rate > 0:
        raise ValueError(f"the request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    offsets, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


# ---- one request -----------------------------------------------------------------------


@dataclass
class Job:
    """One request to send: its prompt, its max_tokens, and its prompt tokens where the
    workload knows them (token-id prompts; chat prompts are counted by whoever runs them)."""

    request_id: str
    prompt: Prompt
    max_tokens: int
    prompt_tokens: int | None = None


@dataclass
class Sample:
    """What one request measured (seconds)."""

    ttft: float
    e2e: float
    itl: list[float]
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the server did not say
    text: str

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def measure(backend: Backend, job: Job) -> Sample:
    """Send one streamed request and time its outputs (see the module docstring)."""
    request = BackendRequest(job.request_id, job.prompt, params(job.max_tokens), stream=True)
    first = last = end = None
    itl: list[float] = []
    final = None
    send = time.perf_counter()
    stream = backend.generate(request)
    try:
        async for output in stream:
            now = time.perf_counter()
            if output.delta:
                if last is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
            if output.finished:
                final, end = output, now
    finally:
        await stream.aclose()
    if final is None:
        raise RequestRejected("the request ended without an answer")
    report = final.server
    if report is not None:
        output_tokens = report.completion_tokens
        cached = report.cached_tokens
        counted_prompt = report.prompt_tokens
    else:
        output_tokens = len(final.token_ids)
        cached = final.num_cached_tokens
        counted_prompt = len(final.prompt_token_ids)
    return Sample(
        ttft=(first if first is not None else end) - send,
        e2e=end - send,
        itl=itl,
        output_tokens=output_tokens,
        prompt_tokens=job.prompt_tokens if job.prompt_tokens is not None else counted_prompt,
        cached_tokens=cached,
        text=final.text,
    )


async def run_jobs(
    backend: Backend, jobs: list[Job], offsets: list[float], max_concurrency: int | None
) -> tuple[list[Sample], float]:
    """Send `jobs` at their offsets, at most `max_concurrency` in flight; (samples in job
    order, wall seconds). The first failure cancels the rest and is raised."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(job: Job, offset: float) -> Sample:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limit if limit is not None else contextlib.nullcontext():
            return await measure(backend, job)

    tasks = [asyncio.create_task(one(job, offset)) for job, offset in zip(jobs, offsets)]
    try:
        samples = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return list(samples), time.perf_counter() - start


# ---- the plan: the same work for every row ---------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What every row runs: a token-id workload (throughput, prefix) or chat sessions."""

    scenario: str
    request_rate: float
    max_concurrency: int | None
    seed: int
    vocab_size: int
    workload: list[tuple[list[int], int]] | None = None
    system: str | None = None  # chat: the shared system prompt
    chat_max_tokens: list[list[int]] | None = None  # chat: [turn][session]

    def arrivals(self) -> random.Random:
        return random.Random(self.seed + 1)  # seed: the workload, seed - 1: the prefix


def workload_model(engine_config: EngineConfig):
    """The resolved `--model` and its transformers config (no weights loaded)."""
    from pagecli.loader.hf_config import load_hf_config
    from pagecli.loader.resolve import resolve_model

    try:
        source = resolve_model(engine_config.model)
        return source, load_hf_config(source)
    except Exception as exc:
        raise load_error(engine_config, exc) from None


def chat_system_prompt(source, engine_config: EngineConfig, prefix_len: int) -> str:
    """scenarios.py's system prompt, sized with the tokenizer of `--model`."""
    from pagecli.tokenizer import Tokenizer

    if not source.has_tokenizer:
        raise CliError(
            f"the chat scenario sizes its system prompt with the tokenizer of --model, and "
            f"{source.name} has none",
            exit_code=2,
        )
    try:
        tokenizer = Tokenizer(source.path, source.name, engine_config.chat_template)
    except Exception as exc:
        raise load_error(engine_config, exc) from None
    return system_prompt(SimpleNamespace(tokenizer=tokenizer), prefix_len)


def make_plan(
    engine_config: EngineConfig,
    scenario: str,
    *,
    workload: list[tuple[list[int], int]] | None,
    num_prompts: int,
    input_len: Range,
    output_len: Range,
    prefix_len: int,
    sessions: int,
    turns: int,
    request_rate: float,
    max_concurrency: int | None,
    save_workload: Path | None = None,
) -> tuple[Plan, str]:
    """The plan and the name of the model whose vocabulary (and tokenizer) drew it."""
    if scenario not in SCENARIOS:
        raise CliError(
            f"--endpoint runs the {', '.join(SCENARIOS)} scenarios, not {scenario}", exit_code=2
        )
    seed = engine_config.seed
    source, hf_config = workload_model(engine_config)
    vocab = hf_config.vocab_size
    common = dict(
        scenario=scenario,
        request_rate=request_rate,
        max_concurrency=max_concurrency,
        seed=seed,
        vocab_size=vocab,
    )
    if scenario == "chat":
        rng = random.Random(seed)  # the draws of scenarios.run_chat, in its order
        max_tokens = [[output_len.draw(rng) for _ in range(sessions)] for _ in range(turns)]
        system = chat_system_prompt(source, engine_config, prefix_len)
        return Plan(**common, system=system, chat_max_tokens=max_tokens), source.name
    if workload is None:
        prefix = None
        if scenario == "prefix":
            prefix = random_ids(random.Random(seed - 1), prefix_len, vocab)
        workload = draw_workload(num_prompts, input_len, output_len, vocab, seed, prefix)
    if save_workload is not None:
        write_workload(save_workload, workload)
    return Plan(**common, workload=workload), source.name


# ---- one backend: start, warm up, measure, close ---------------------------------------


async def warm_up(backend: Backend, plan: Plan) -> None:
    """A burst of up to WARMUP_REQUESTS small requests at once, prompts from 16 tokens to the
    workload's longest (at most 512): every row, a fresh in-process engine as much as a server
    that ran before, meets the measured batch shapes warm. Random ids of their own, so no
    prefix-cache hit carries over into the workload."""
    rng = random.Random(-1)
    longest = max([len(ids) for ids, _ in plan.workload or []] or [WARMUP_PROMPT_TOKENS])
    longest = max(WARMUP_PROMPT_TOKENS, min(WARMUP_MAX_PROMPT_TOKENS, longest))
    num = min(WARMUP_REQUESTS, plan.max_concurrency or WARMUP_REQUESTS)
    lengths = [
        WARMUP_PROMPT_TOKENS + (longest - WARMUP_PROMPT_TOKENS) * i // max(1, num - 1)
        for i in range(num)
    ]
    await asyncio.gather(
        *(
            backend.complete(
                BackendRequest(
                    f"bench-warmup-{i}",
                    {"prompt_token_ids": random_ids(rng, n, plan.vocab_size)},
                    params(WARMUP_OUTPUT_TOKENS),
                    stream=True,
                )
            )
            for i, n in enumerate(lengths)
        )
    )


async def run_workload(backend: Backend, plan: Plan) -> tuple[list[Sample], float, dict]:
    jobs = [
        Job(f"bench-{i}", {"prompt_token_ids": ids}, max_tokens, len(ids))
        for i, (ids, max_tokens) in enumerate(plan.workload)
    ]
    offsets = arrival_offsets(len(jobs), plan.request_rate, plan.arrivals())
    samples, wall = await run_jobs(backend, jobs, offsets, plan.max_concurrency)
    return samples, wall, {}


async def run_chat_sessions(backend: Backend, plan: Plan) -> tuple[list[Sample], float, dict]:
    """All sessions' turn 1 at once (under the rate and concurrency limits), then turn 2, ...;
    each session keeps its own assistant replies in its messages."""
    turns = len(plan.chat_max_tokens)
    sessions = len(plan.chat_max_tokens[0])
    rng = plan.arrivals()
    messages = [[{"role": "system", "content": plan.system}] for _ in range(sessions)]
    per_turn: list[list[Sample]] = []
    wall = 0.0
    for turn in range(turns):
        jobs = []
        for s in range(sessions):
            messages[s].append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            jobs.append(
                Job(f"bench-t{turn}-s{s}", list(messages[s]), plan.chat_max_tokens[turn][s])
            )
        offsets = arrival_offsets(sessions, plan.request_rate, rng)
        samples, turn_wall = await run_jobs(backend, jobs, offsets, plan.max_concurrency)
        wall += turn_wall
        for s, sample in enumerate(samples):
            messages[s].append({"role": "assistant", "content": sample.text})
        per_turn.append(samples)
    extra = {
        "sessions": sessions,
        "turns": [
            {
                "turn": turn + 1,
                "prompt_tokens": _mean([s.prompt_tokens for s in samples]),
                "cached_tokens": _mean_known([s.cached_tokens for s in samples]),
                "ttft_s": _mean([s.ttft for s in samples]),
            }
            for turn, samples in enumerate(per_turn)
        ],
    }
    return [s for samples in per_turn for s in samples], wall, extra


def serving_row(
    backend: Backend, description: dict[str, Any], plan: Plan, samples: list[Sample], wall: float
) -> dict:
    """A result row: the counts and rates of scenarios.py plus client-side latencies."""
    row: dict[str, Any] = {
        "engine": backend.name,
        **description,
        "model": backend.model_name,
        "num_requests": len(samples),
        "prompt_tokens": sum(s.prompt_tokens for s in samples),
        "output_tokens": sum(s.output_tokens for s in samples),
        "wall_s": wall,
    }
    rates(row)
    row.update(
        {
            "ttft_s": summary([s.ttft for s in samples]),
            "tpot_s": summary([s.tpot for s in samples if s.tpot is not None]),
            "itl_s": summary([gap for s in samples for gap in s.itl]),
            "e2e_s": summary([s.e2e for s in samples]),
        }
    )
    known = [s.cached_tokens for s in samples if s.cached_tokens is not None]
    row["cached_tokens"] = sum(known) if known else None
    if plan.scenario != "throughput" and known and row["prompt_tokens"]:
        row["prefix_hit_rate"] = row["cached_tokens"] / row["prompt_tokens"]
    row["request_rate"] = rate_value(plan.request_rate)
    row["max_concurrency"] = plan.max_concurrency
    return row


async def bench_backend(backend: Backend, plan: Plan, engine_config: EngineConfig) -> dict:
    """One row: start the backend, warm it up, measure, close it (whatever happens)."""
    if _is_local(backend):
        note(f"{backend.name}: loading {engine_config.model or 'the default model'}")
    try:
        try:
            await backend.start()
        except (CliError, KeyboardInterrupt, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise start_error(backend, engine_config, exc) from None
        try:
            await warm_up(backend, plan)
            if plan.scenario == "chat":
                sessions = len(plan.chat_max_tokens[0])
                note(
                    f"{backend.name}: chat, {sessions} sessions x {len(plan.chat_max_tokens)} turns"
                )
                samples, wall, extra = await run_chat_sessions(backend, plan)
            else:
                note(f"{backend.name}: {plan.scenario}, {len(plan.workload)} requests")
                samples, wall, extra = await run_workload(backend, plan)
        except RequestRejected as exc:
            raise CliError(f"{backend.name}: a bench request failed: {exc}") from None
        except BackendError as exc:
            raise CliError(f"{backend.name}: {exc}") from None
        row = serving_row(backend, backend.describe(), plan, samples, wall)
        row.update(extra)
        return row
    finally:
        with contextlib.suppress(Exception):
            await backend.aclose()


def _is_local(backend: Backend) -> bool:
    """Whether the row runs on this process's engine (told apart from the remote class: the
    local one's module imports torch)."""
    from pagecli.backends.remote import RemoteBackend

    return not isinstance(backend, RemoteBackend)


async def check_reachable(backends: list[Backend], engine_config: EngineConfig) -> None:
    """Connect to each server once before any row runs (a wrong URL should not wait for a
    whole local row); the local engine is not loaded twice for this."""
    for backend in backends:
        if _is_local(backend):
            continue
        try:
            await backend.start()
        except Exception as exc:
            raise start_error(backend, engine_config, exc) from None
        finally:
            with contextlib.suppress(Exception):
                await backend.aclose()


async def run_rows(backends: list[Backend], plan: Plan, engine_config: EngineConfig) -> list:
    await check_reachable(backends, engine_config)
    rows = []
    while backends:
        backend = backends.pop(0)
        rows.append(await bench_backend(backend, plan, engine_config))
        del backend  # release a local engine before the next row starts
        gc.collect()
    return rows


def bench_endpoints(
    endpoint: EndpointSettings, engine_config: EngineConfig, plan: Plan, model: str
) -> dict:
    """The report of every --endpoint row on `plan`, for report.print_report."""
    backends = endpoint.backends(engine_config)
    info = {
        "machine": machine(),
        "version": __version__,
        "scenario": plan.scenario,
        "endpoints": list(endpoint.urls),
        "workload_model": model,
        "vocab_size": plan.vocab_size,
        "request_rate": rate_value(plan.request_rate),
        "max_concurrency": plan.max_concurrency,
        "seed": plan.seed,
    }
    rows = asyncio.run(run_rows(backends, plan, engine_config))
    return {**info, "results": rows}


def rate_value(rate: float) -> float | str:
    """A request rate for the report: "inf" (as vllm writes it) or the number."""
    return "inf" if math.isinf(rate) else rate


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _mean_known(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return _mean(known) if known else None
