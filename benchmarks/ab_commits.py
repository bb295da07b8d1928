"""pagecli against an earlier pagecli on one file: the A/B that says a change kept the speed.

Runs `pagecli bench --scenario latency --pp P --tg T --json` from two checkouts of pagecli (this
one, B, and another one, A, given by --base: a `git worktree` of the commit to compare with),
--rounds times, in turn first, each on the same GGUF file (or the default model) and thread
count. Both use this venv's packages; each run starts in its own checkout with PYTHONPATH on
it (its native library is built from its own C sources, into the same cache keyed by them;
`run_side` says why the working directory matters). Prints
each side's median pp and tg rates and the median of the rounds' own B/A ratios, with the CPU
named. Quiet machines only.

    .venv/bin/python benchmarks/ab_commits.py --base /path/to/worktree [--model FILE.gguf]
        [--threads 2] [--rounds 5] [--pp 512] [--tg 128] [--json OUT.json]
        [--bench-args "--dtype bfloat16 --quantization none"] [--head /path/to/b-worktree]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from quant_vs_llamacpp import cpu_name

HERE = Path(__file__).resolve().parent.parent


def run_side(checkout: Path, args: list[str]) -> str:
    """`pagecli ARGS` run from `checkout`'s code; its stdout. It runs in the checkout's
    directory: `python -c` puts the working directory first on sys.path, before PYTHONPATH, so
    run from this repository's root the other side would import this checkout's pagecli."""
    code = "import sys; from pagecli.cli.entry import main; sys.argv[0] = 'pagecli'; main()"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, "-c", code, *args]
    return subprocess.run(
        argv, check=True, stdout=subprocess.PIPE, text=True, env=env, cwd=checkout
    ).stdout


def bench(
    checkout: Path, model: str | None, threads: int, pp: int, tg: int, extra: list[str]
) -> dict:
    """One `pagecli bench` run of `checkout`'s code (`extra`: more bench arguments):
    {"pp": t/s, "tg": t/s}, without a test whose length is 0."""
    args = ["bench", "--scenario", "latency", "--pp", str(pp), "--tg", str(tg)]
    args += ["--num-threads", str(threads), "--json"]
    if model is not None:
        args += ["--model", model]
    out = run_side(checkout, args + extra)
    rates = {row["test"]: row["tokens_per_s_mean"] for row in json.loads(out)["results"]}
    lengths = {"pp": pp, "tg": tg}
    return {key: rates[f"{key}{n}"] for key, n in lengths.items() if n > 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the A checkout")
    parser.add_argument("--head", type=Path, default=HERE, help="the B checkout (this one)")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pp", type=int, default=512)
    parser.add_argument("--tg", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--bench-args", default="", help="more arguments for both sides' bench")
    args = parser.parse_args()
    keys = [key for key, n in (("pp", args.pp), ("tg", args.tg)) if n > 0]
    if not keys:
        parser.error("--pp and --tg are both 0: nothing to measure")
    extra = shlex.split(args.bench_args)
    if args.model is not None and Path(args.model).exists():
        args.model = str(Path(args.model).resolve())  # the sides run in their checkouts
    sides = {"A": args.base.resolve(), "B": args.head.resolve()}
    rounds = []
    for number in range(args.rounds):
        order = ["A", "B"] if number % 2 == 0 else ["B", "A"]
        row = {
            side: bench(sides[side], args.model, args.threads, args.pp, args.tg, extra)
            for side in order
        }
        for key in keys:
            row[f"{key}_ratio"] = row["B"][key] / row["A"][key]
        print(f"ab_commits: round {number}: {json.dumps(row)}", file=sys.stderr, flush=True)
        rounds.append(row)
    model = (args.model or "the default model") + (f" {args.bench_args}" if extra else "")
    print(f"CPU: {cpu_name()}; {args.threads} threads; {model}; A = {sides['A']}, B = {sides['B']}")
    print("| | A t/s | B t/s | B/A (median of rounds; each round) |")
    print("| --- | --- | --- | --- |")
    for key in keys:
        a = statistics.median(r["A"][key] for r in rounds)
        b = statistics.median(r["B"][key] for r in rounds)
        each = ", ".join(f"{r[f'{key}_ratio']:.3f}" for r in rounds)
        median = statistics.median(r[f"{key}_ratio"] for r in rounds)
        print(f"| {key}{args.pp if key == 'pp' else args.tg} | {a:.1f} | {b:.1f} | "
              f"{median:.3f} ({each}) |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "model": model, "rounds": rounds}))


if __name__ == "__main__":
    main()
