"""Decode with sampling (temperature, top-p) against greedy, and two trees against each other:
what drawing a token costs a decode step (a script).

    .venv/bin/python benchmarks/sampling_ab.py [--base DIR] [--model FILE.gguf]
        [--temperature 0.8] [--top-p 0.95] [--tokens 64] [--batch 1] [--rounds 5] [--threads 2]

Each round runs, in a fresh process per tree (`--base`: another checkout, such as a
`git worktree` of the parent commit; without it only this tree), `--batch` requests of
`--tokens` tokens at once greedy, then sampled, in an engine of that many sequences, and
records the decode rate (output tokens/s after the last first token; at batch 1 that of the
one request). Prints the medians and the ratios to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from pagecli import LLM, SamplingParams
model, tokens, temperature, top_p, threads, batch = sys.argv[2:8]
batch = int(batch)
llm = LLM(model if model != "-" else None, max_num_seqs=batch, num_threads=int(threads) or None)
prompts = [[{"role": "user", "content": f"Write a long story about lighthouse keeper {i}."}]
           for i in range(batch)]
out = {}
llm.generate(prompts[:1], SamplingParams(max_tokens=4))
for name, params in (
    ("greedy", SamplingParams(temperature=0, max_tokens=int(tokens), ignore_eos=True)),
    ("sampled", SamplingParams(temperature=float(temperature), top_p=float(top_p),
                               max_tokens=int(tokens), ignore_eos=True)),
):
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    first = max(r.metrics.get("first_token_time", start) for r in results)
    decoded = sum(len(r.token_ids) - 1 for r in results)
    out[name] = decoded / (time.perf_counter() - first)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=None)
    parser.add_argument("--model", default="-")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    trees = {"this": str(ROOT)}
    if args.base:
        trees = {"base": str(Path(args.base).resolve()), **trees}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            command = [sys.executable, "-c", CHILD, tree, args.model, str(args.tokens)]
            command += [str(args.temperature), str(args.top_p), str(args.threads)]
            command += [str(args.batch)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr)
    print(
        f"model {args.model}, temperature {args.temperature}, top_p {args.top_p}, "
        f"batch {args.batch}"
    )
    print("| tree | greedy t/s | sampled t/s | sampled / greedy |")
    print("| --- | --- | --- | --- |")
    medians = {}
    for name in trees:
        greedy = statistics.median(x["greedy"] for x in runs[name])
        sampled = statistics.median(x["sampled"] for x in runs[name])
        medians[name] = (greedy, sampled)
        print(f"| {name} | {greedy:.2f} | {sampled:.2f} | {sampled / greedy:.3f} |")
    if args.base:
        ratios = [t["sampled"] / b["sampled"] for b, t in zip(runs["base"], runs["this"])]
        print(f"sampled, this / base: {statistics.median(ratios):.3f} (rounds {ratios})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
