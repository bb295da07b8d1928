"""What HTTP costs: `pagecli serve` against the in-process engine, on the same workload.

1. Throughput: `pagecli bench`'s default workload (64 requests, 32..512 prompt tokens,
   16..256 output tokens, seed 0; greedy, ignore_eos) run in-process, then sent to a
   `pagecli serve` subprocess as 64 concurrent streaming /v1/completions requests with token-id
   prompts. Output tok/s of each, and their ratio.
2. Added time to first token on an idle engine: 20 requests one at a time (a 128-token prompt,
   prefix caching off so each one prefills in full), in-process `LLM.stream` against a
   streaming HTTP request; medians and their difference.

    .venv/bin/python benchmarks/serve_overhead.py [--repetitions 1] [--skip-throughput]

Run it on a quiet machine: it alternates the in-process and server runs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _servers import start_and_wait  # benchmarks/ is on sys.path when a script here runs

from pagecli import LLM, SamplingParams
from pagecli.bench.scenarios import EngineRunner, Range, draw_workload

PAGECLI = str(Path(sys.executable).with_name("pagecli"))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    command = [PAGECLI, "serve", "--port", str(port), "--no-display", *extra]
    return start_and_wait(command, port, "pagecli serve")


async def stream_one(http: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int):
    """(seconds to the first text, seconds to the end, output tokens)."""
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    tokens = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, time.perf_counter() - start, tokens


async def serve_throughput(url: str, workload) -> dict:
    limits = httpx.Limits(max_connections=len(workload) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        await stream_one(http, url, workload[0][0][:16], 4)  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(http, url, ids, n) for ids, n in workload))
        wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}


async def serve_ttft(url: str, ids: list[int], count: int) -> list[float]:
    async with httpx.AsyncClient(timeout=None) as http:
        await stream_one(http, url, ids, 2)
        return [(await stream_one(http, url, ids, 2))[0] for _ in range(count)]


def inprocess_ttft(llm: LLM, ids: list[int], count: int) -> list[float]:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = []
    for _ in range(count + 1):
        start = time.perf_counter()
        for output in llm.stream({"prompt_token_ids": ids}, params):
            if output.token_ids:
                out.append(time.perf_counter() - start)
                break
    return out[1:]  # the first one warms up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8931)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    print(f"# {cpu_name()}, {platform.machine()}, default model, float32", flush=True)

    # ---- added time to first token (prefix caching off: every request prefills in full) ----
    llm = LLM(None, enable_prefix_caching=False)
    vocab = llm.engine.hf_config.vocab_size
    ttft_ids = draw_workload(1, Range(128, 128), Range(2, 2), vocab, seed=5)[0][0]
    local = inprocess_ttft(llm, ttft_ids, args.ttft_requests)
    del llm
    gc.collect()
    server = start_server(args.port, ["--no-prefix-caching"])
    try:
        remote = asyncio.run(serve_ttft(url, ttft_ids, args.ttft_requests))
    finally:
        server.terminate()
        server.wait(60)
    lm, rm = statistics.median(local), statistics.median(remote)
    print(
        f"TTFT, 128-token prompt, idle engine, median of {args.ttft_requests}: in-process "
        f"{lm * 1e3:.1f} ms, serve {rm * 1e3:.1f} ms, added {(rm - lm) * 1e3:.1f} ms",
        flush=True,
    )
    if args.skip_throughput:
        return

    # ---- throughput on bench's default workload ---------------------------------------
    workload = draw_workload(args.num_prompts, Range(32, 512), Range(16, 256), vocab, seed=0)
    inproc, served = [], []
    for rep in range(args.repetitions):
        llm = LLM(None)
        row = EngineRunner(llm, lambda: None).run("pagecli", workload)
        inproc.append(row["output_tokens_per_s"])
        del llm
        gc.collect()
        server = start_server(args.port, [])
        try:
            result = asyncio.run(serve_throughput(url, workload))
        finally:
            server.terminate()
            server.wait(60)
        served.append(result["output_tokens_per_s"])
        print(
            f"rep {rep + 1}: in-process {row['output_tokens_per_s']:.1f} output tok/s "
            f"({row['wall_s']:.1f} s), serve {result['output_tokens_per_s']:.1f} output tok/s "
            f"({result['wall_s']:.1f} s, {result['output_tokens']} tokens)",
            flush=True,
        )
    a, b = statistics.median(inproc), statistics.median(served)
    print(
        f"throughput, {args.num_prompts} requests, median of {args.repetitions}: in-process "
        f"{a:.1f}, serve {b:.1f} output tok/s: serve/in-process = {b / a:.3f}"
    )


if __name__ == "__main__":
    main()
