"""The workloads and scenarios of `pagecli bench`, run in-process through the engine.

A workload is a list of `(prompt_token_ids, max_tokens)`; every request is greedy and ignores
EOS, so each engine does exactly the same work. Each scenario returns result rows (plain
dicts, one per engine run) for bench.py to print.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pagecli.cli.options import CliError
from pagecli.llm import LLM
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import SamplingParams

Request = tuple[list[int], int]
Refresh = Callable[..., None]
TOKEN_MARGIN = 100  # random prompt ids stay clear of the special tokens at both ends


@dataclass(frozen=True)
class Range:
    """A token count, or a range drawn uniformly (`MIN[:MAX]`)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, name: str) -> Range:
        parts = text.split(":")
        try:
            low, high = int(parts[0]), int(parts[-1])
        except ValueError:
            raise CliError(f"{name} must be N or MIN:MAX, got {text!r}", exit_code=2) from None
        if len(parts) > 2 or low < 1 or high < low:
            raise CliError(f"{name} must be N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}", 2)
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randint(TOKEN_MARGIN, vocab_size - TOKEN_MARGIN) for _ in range(n)]


def draw_workload(
    num_prompts: int,
    input_len: Range,
    output_len: Range,
    vocab_size: int,
    seed: int,
    prefix: list[int] | None = None,
) -> list[Request]:
    """`num_prompts` random requests (after an optional shared prefix), the same for a seed."""
    rng = random.Random(seed)
    workload = []
    for _ in range(num_prompts):
        ids = random_ids(rng, input_len.draw(rng), vocab_size)
        workload.append(((prefix or []) + ids, output_len.draw(rng)))
    return workload


def read_workload(path: Path) -> list[Request]:
    """A JSONL workload in `generate`'s input format (`prompt_token_ids` and `max_tokens`)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"{path}: cannot read the workload ({exc.strerror})", exit_code=2) from None
    workload = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            ids, max_tokens = record["prompt_token_ids"], record["max_tokens"]
            if not (ids and all(isinstance(t, int) for t in ids) and isinstance(max_tokens, int)):
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise CliError(
                f"{path}:{number}: a workload line needs prompt_token_ids (a list of integers) "
                "and max_tokens (an integer)",
                exit_code=2,
            ) from None
        workload.append((ids, max_tokens))
    if not workload:
        raise CliError(f"{path}: the workload is empty", exit_code=2)
    return workload


def write_workload(path: Path, workload: Iterable[Request]) -> None:
    """Write the workload as `generate` input, greedy and ignoring EOS like the bench."""
    with path.open("w") as f:
        for i, (ids, max_tokens) in enumerate(workload):
            record = {
                "id": i,
                "prompt_token_ids": ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            f.write(json.dumps(record) + "\n")


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def summary(values: list[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 (linear interpolation), or None without values."""
    if not values:
        return None
    ordered = sorted(values)

    def pct(q: float) -> float:
        pos = q * (len(ordered) - 1)
        low, high = math.floor(pos), math.ceil(pos)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"mean": statistics.fmean(ordered), "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def rates(row: dict) -> dict:
    """Add requests/s, output tokens/s and total tokens/s to a row with counts and wall_s."""
    wall = row["wall_s"]
    row["requests_per_s"] = row["num_requests"] / wall if wall else 0.0
    row["output_tokens_per_s"] = row["output_tokens"] / wall if wall else 0.0
    row["total_tokens_per_s"] = (
        (row["prompt_tokens"] + row["output_tokens"]) / wall if wall else 0.0
    )
    return row


def latency_figures(outputs: list[RequestOutput]) -> dict:
    """TTFT, TPOT and end-to-end latency summaries from the outputs' metrics (seconds)."""
    ttft, tpot, e2e = [], [], []
    for out in outputs:
        m = out.metrics
        if "first_token_time" in m:
            ttft.append(m["first_token_time"] - m["arrival_time"])
        if "finished_time" in m:
            e2e.append(m["finished_time"] - m["arrival_time"])
            if "first_token_time" in m and len(out.token_ids) > 1:
                tpot.append((m["finished_time"] - m["first_token_time"]) / (len(out.token_ids) - 1))
    return {"ttft_s": summary(ttft), "tpot_s": summary(tpot), "e2e_s": summary(e2e)}


class EngineRunner:
    """Runs workloads on one loaded LLM, one request id namespace, warm before timing."""

    def __init__(self, llm: LLM, refresh: Refresh) -> None:
        self.llm, self.engine, self.refresh = llm, llm.engine, refresh
        self._next_id = 0
        self.warm = False

    def run_requests(self, workload: list[Request]) -> tuple[list[RequestOutput], float, int]:
        """Add all requests, step to the end; (outputs in order, wall seconds, peak blocks)."""
        engine = self.engine
        ids = []
        start = time.perf_counter()
        for number, (prompt_ids, max_tokens) in enumerate(workload, start=1):
            ids.append(f"bench-{self._next_id}")
            self._next_id += 1
            try:
                engine.add_request(ids[-1], prompt_ids, params(max_tokens))
            except ValueError as exc:  # RequestError too: it cannot fit this engine
                for request_id in ids:
                    engine.abort_request(request_id)
                raise CliError(f"workload request {number}: {exc}", exit_code=2) from None
        done: dict[str, RequestOutput] = {}
        peak = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            peak = max(peak, engine.block_manager.num_used_blocks)
            self.refresh()
        return [done[i] for i in ids], time.perf_counter() - start, peak

    def warm_up(self) -> None:
        if not self.warm:
            vocab = self.engine.hf_config.vocab_size
            self.run_requests([(random_ids(random.Random(-1), 16, vocab), 4)])
            self.warm = True

    def run(self, name: str, workload: list[Request]) -> dict:
        """One timed run of the workload: a result row."""
        self.warm_up()
        before = self.engine.stats()
        outputs, wall, peak = self.run_requests(workload)
        after = self.engine.stats()
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise CliError(f"a bench request failed: {errors[0]}")
        queried = after.prefix_query_tokens - before.prefix_query_tokens
        hits = after.prefix_hit_tokens - before.prefix_hit_tokens
        row = {
            "engine": name,
            "num_requests": len(workload),
            "prompt_tokens": sum(len(ids) for ids, _ in workload),
            "output_tokens": sum(len(o.token_ids) for o in outputs),
            "wall_s": wall,
        }
        rates(row)
        row.update(latency_figures(outputs))
        row.update(
            {
                "peak_kv_blocks": peak,
                "num_kv_blocks": after.num_blocks,
                "peak_kv_usage": peak / after.num_blocks,
                "preemptions": (after.preemptions_recompute + after.preemptions_swap)
                - (before.preemptions_recompute + before.preemptions_swap),
                "prefix_hit_rate": hits / queried if queried else 0.0,
                "cached_tokens": sum(o.num_cached_tokens for o in outputs),
                "kv_groups": list(after.kv_groups),
                "window_freed_blocks": after.window_freed_blocks - before.window_freed_blocks,
                "state_snapshots_saved": after.state_snapshots_saved - before.state_snapshots_saved,
            }
        )
        return row


# ---- chat ------------------------------------------------------------------------------

SYSTEM_SENTENCE = (
    "You are a careful assistant for a small engineering team; answer briefly, cite the "
    "relevant file when you can, and say so plainly when you do not know. "
)
USER_TURNS = [
    "How do I read a JSONL file line by line in Python?",
    "And how would I skip the lines that fail to parse?",
    "Can you make that a generator function?",
    "What should the function return at the end?",
    "Write one test for it with pytest.",
    "Thanks. Summarise the approach in one sentence.",
]


def system_prompt(llm: LLM, min_tokens: int) -> str:
    """A system prompt of at least `min_tokens` tokens."""
    text = SYSTEM_SENTENCE
    while len(llm.tokenizer.encode(text)) < min_tokens:
        text += SYSTEM_SENTENCE
    return text


def run_chat(
    llm: LLM,
    refresh: Refresh,
    sessions: int,
    turns: int,
    output_len: Range,
    prefix_len: int,
    seed: int,
) -> dict:
    """`sessions` conversations of `turns` turns sharing a system prompt, turn by turn."""
    if llm.tokenizer is None:
        raise CliError("the chat scenario needs a model with a tokenizer", exit_code=2)
    runner = EngineRunner(llm, refresh)
    runner.warm_up()
    rng = random.Random(seed)
    system = system_prompt(llm, prefix_len)
    chats = [llm.chat_session(system=system, name=f"s{i}") for i in range(sessions)]
    outputs: list[list[RequestOutput]] = [[] for _ in range(turns)]
    prompt_tokens = 0
    start = time.perf_counter()
    for turn in range(turns):
        for chat in chats:
            final = None
            for final in chat.stream(  # noqa: B007 (the last output is the turn's result)
                USER_TURNS[turn % len(USER_TURNS)], params(output_len.draw(rng))
            ):
                refresh()
            outputs[turn].append(final)
            prompt_tokens += len(final.prompt_token_ids)
    wall = time.perf_counter() - start
    every = [o for turn_outputs in outputs for o in turn_outputs]
    row = {
        "engine": "pagecli",
        "num_requests": len(every),
        "prompt_tokens": prompt_tokens,
        "output_tokens": sum(len(o.token_ids) for o in every),
        "wall_s": wall,
    }
    rates(row)
    row.update(latency_figures(every))
    first = outputs[0]
    row["ttft_first_session_s"] = _ttft(first[0])
    row["ttft_later_sessions_s"] = (
        statistics.fmean(_ttft(o) for o in first[1:]) if len(first) > 1 else None
    )
    row["turns"] = [
        {
            "turn": turn + 1,
            "prompt_tokens": statistics.fmean(len(o.prompt_token_ids) for o in outs),
            "cached_tokens": statistics.fmean(o.num_cached_tokens for o in outs),
            "ttft_s": statistics.fmean(_ttft(o) for o in outs),
        }
        for turn, outs in enumerate(outputs)
    ]
    row["cached_tokens"] = sum(o.num_cached_tokens for o in every)
    row["prefix_hit_rate"] = row["cached_tokens"] / prompt_tokens if prompt_tokens else 0.0
    return row


def _ttft(out: RequestOutput) -> float:
    return out.metrics["first_token_time"] - out.metrics["arrival_time"]


# ---- latency ---------------------------------------------------------------------------


def run_latency(llm: LLM, refresh: Refresh, pp: int, tg: int, repetitions: int, seed: int) -> list:
    """llama-bench style: pp = prompt tokens/s of one request, tg = generated tokens/s."""
    runner = EngineRunner(llm, refresh)
    runner.warm_up()
    vocab = llm.engine.hf_config.vocab_size
    rng = random.Random(seed)
    if pp:  # untimed, as llama-bench warms up: the first prompt of its length touches the
        # KV blocks and work buffers it needs for the first time (page faults, allocation)
        runner.run_requests([(random_ids(random.Random(-2), pp, vocab), 1)])
    rows = []
    tests = [(f"pp{pp}", pp, 1), (f"tg{tg}", 1, tg)]
    for name, num_prompt, num_out in tests:
        if (num_prompt if name.startswith("pp") else num_out) == 0:
            continue
        speeds, walls = [], []
        for _ in range(repetitions):  # fresh random ids each time: no prefix-cache hits
            (out,), wall, _ = runner.run_requests([(random_ids(rng, num_prompt, vocab), num_out)])
            walls.append(wall)
            speeds.append((num_prompt if name.startswith("pp") else num_out) / wall)
        row = {
            "engine": "pagecli",
            "test": name,
            "num_requests": repetitions,
            "prompt_tokens": num_prompt * repetitions,
            "output_tokens": num_out * repetitions,
            "wall_s": sum(walls),
        }
        rates(row)
        row["tokens_per_s_mean"] = statistics.fmean(speeds)
        row["tokens_per_s_std"] = statistics.stdev(speeds) if len(speeds) > 1 else 0.0
        rows.append(row)
    return rows
