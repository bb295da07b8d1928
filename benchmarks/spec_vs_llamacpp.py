"""llama.cpp's own speculative decoding on the workloads of `pagecli bench --scenario spec`:
the peer's speed-up beside pagecli's, on the same GGUF file, prompts and thread count.

llama-server (../shared/peers/llama.cpp) runs twice on the file: without speculation, then
with `--spec-type` ngram-simple (prompt lookup, its n-gram sizes given below) or, with
`--draft FILE`, a draft model (pagecli's rows then use it too). Each workload's requests go
one at a time through /v1/chat/completions (the file's chat template; greedy, to EOS or
max_tokens), `repetitions` times, and the server's own decode rate
(timings.predicted_per_second) is kept: the median per workload and mode, their ratio, and
llama.cpp's draft counts. pagecli's rows come from `pagecli bench --scenario spec` on the
same file (one process, off and on), run first.

    .venv/bin/python benchmarks/spec_vs_llamacpp.py FILE.gguf [--threads 2] [--repetitions 3]
        [--max-tokens 96] [--num-prompts 2] [--ngram-n 3] [--ngram-m 16] [--json OUT]
        [--skip-pagecli]

Run it on a quiet machine: the two engines take turns, never side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
from _servers import start_and_wait  # benchmarks/ is on sys.path when a script here runs

from pagecli.bench.spec import workloads

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT.parent / "shared" / "peers" / "llama.cpp" / "bin" / "llama-server"
PAGECLI = str(Path(sys.executable).with_name("pagecli"))


def start_server(model: str, threads: int, port: int, extra: list[str]) -> subprocess.Popen:
    command = [str(PEER), "-m", model, "-t", str(threads), "--host", "127.0.0.1"]
    command += ["--port", str(port), "-c", "8192", "-np", "1", *extra]
    return start_and_wait(command, port, "llama-server")


def peer_rows(args, extra: list[str], port: int) -> dict[str, dict]:
    """Per workload: the decode rates of each request and repetition, the replies, and the
    draft counts, from one llama-server."""
    proc = start_server(args.model, args.threads, port, extra)
    out: dict[str, dict] = {}
    try:
        with httpx.Client(timeout=600) as client:
            for name, requests in workloads(args.num_prompts).items():
                rates, texts, drafted, accepted = [], [], 0, 0
                for messages in requests:
                    for _ in range(args.repetitions):
                        body = {
                            "messages": messages,
                            "temperature": 0,
                            "max_tokens": args.max_tokens,
                            "cache_prompt": False,
                        }
                        reply = client.post(
                            f"http://127.0.0.1:{port}/v1/chat/completions", json=body
                        ).json()
                        timings = reply["timings"]
                        rates.append(timings["predicted_per_second"])
                        drafted += timings.get("draft_n", 0)
                        accepted += timings.get("draft_n_accepted", 0)
                    texts.append(reply["choices"][0]["message"]["content"])
                out[name] = {
                    "decode_tps": rates,
                    "median_tps": statistics.median(rates),
                    "texts": texts,
                    "draft_tokens": drafted,
                    "accepted_tokens": accepted,
                }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def pagecli_rows(args) -> list[dict]:
    command = [PAGECLI, "bench", "--model", args.model, "--scenario", "spec", "--json"]
    command += ["--num-prompts", str(args.num_prompts), "--output-len", str(args.max_tokens)]
    command += ["--repetitions", str(args.repetitions), "--num-threads", str(args.threads)]
    if args.draft:  # the same draft model and draft count as the peer's
        command += ["--model-draft", args.draft, "--draft-max", "5"]
    else:
        command += ["--spec-type", "ngram"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--ngram-n", type=int, default=3, help="llama.cpp's lookup n-gram")
    parser.add_argument("--ngram-m", type=int, default=16, help="llama.cpp's draft length")
    parser.add_argument("--draft", help="a draft model for both engines instead of prompt lookup")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--skip-pagecli", action="store_true")
    args = parser.parse_args()
    if not PEER.exists():
        raise SystemExit(f"no peer binary at {PEER}")

    result: dict = {"model": args.model, "threads": args.threads, "args": vars(args)}
    if not args.skip_pagecli:
        result["pagecli"] = pagecli_rows(args)
    if args.draft:
        spec = ["-md", args.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", "5"]
    else:
        spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(args.ngram_n)]
        spec += ["--spec-ngram-simple-size-m", str(args.ngram_m)]
    result["llama_off"] = peer_rows(args, [], 18931)
    result["llama_on"] = peer_rows(args, spec, 18932)
    result["llama_spec_args"] = spec

    ours = {row["workload"]: row for row in result.get("pagecli", {}).get("results", [])}
    print(
        "| workload | pagecli off / on t/s | speed-up | llama.cpp off / on t/s | speed-up "
        "| llama.cpp accepted |",
        file=sys.stderr,
    )
    for name in result["llama_off"]:
        off, on = result["llama_off"][name], result["llama_on"][name]
        same = off["texts"] == on["texts"]
        rate = on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else 0.0
        ratio = on["median_tps"] / off["median_tps"]
        mine = ours.get(name)
        mine_text = (
            "-"
            if mine is None
            else (
                f"{mine['decode_tokens_per_s_off']:.2f} / {mine['decode_tokens_per_s_on']:.2f} "
                f"| {mine['speedup']:.2f}x"
            )
        )
        print(
            f"| {name} | {mine_text} | {off['median_tps']:.2f} / {on['median_tps']:.2f} "
            f"| {ratio:.2f}x | {rate:.0%} (same text: {same}) |",
            file=sys.stderr,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
