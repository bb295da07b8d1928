"""n-gram speculation in a batch: several requests decoding together, speculation on against
off in one engine (a script).

Loads MODEL once with prompt lookup (`--speculative-config '{"method": "ngram"}'`) and
--max-num-seqs as large as the batch, then for each batch size N runs the first N of the spec
scenario's requests (code edits, quotes, JSON extractions and chats of this repository's
source, interleaved; pagecli/bench/spec.py) together, greedy, --max-tokens each, with the
proposer on and taken away, the two alternating over --rounds rounds after one warm-up round
of each. Prints the decode tokens/s of each side (median of the rounds), on / off (the
median of the rounds' ratios, each round's two sides run next to each other), the rounds'
ratios, the step costs the policy measured (ms by rows), and whether both sides gave the
same tokens.

    .venv/bin/python benchmarks/spec_batch.py MODEL.gguf [--batches 1,2,4,8] [--rounds 4]
        [--max-tokens 64] [--threads N] [--json OUT.json]

To compare two commits, run it from each checkout (a `git worktree` with PYTHONPATH set to
it) one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from quant_vs_llamacpp import cpu_name  # noqa: E402

from pagecli import LLM, SamplingParams  # noqa: E402
from pagecli.bench.spec import workloads  # noqa: E402


def requests(count: int) -> list[list[dict]]:
    """The spec scenario's requests, the four workloads taking turns."""
    groups = list(workloads(3).values())
    ordered = [group[i] for i in range(3) for group in groups]
    return [ordered[i % len(ordered)] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        args.model,
        num_threads=args.threads,
        max_num_seqs=max(batches),
        speculative_config={"method": "ngram"},
    )
    engine = llm.engine
    proposer = engine.proposer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for count in batches:
        prompts = requests(count)
        seconds: dict[str, list[float]] = {"off": [], "on": []}
        tokens: dict[str, list[list[int]]] = {}
        for round_ in range(args.rounds + 1):  # round 0 warms both sides up
            for side in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                engine.proposer = proposer if side == "on" else None
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                if round_:
                    seconds[side].append(time.perf_counter() - start)
                tokens[side] = [list(o.token_ids) for o in outputs]
        engine.proposer = proposer
        total = sum(len(t) for t in tokens["off"])
        off, on = (total / statistics.median(seconds[s]) for s in ("off", "on"))
        rounds = [round(a / b, 3) for a, b in zip(seconds["off"], seconds["on"])]
        ratio = statistics.median(rounds)
        costs = {r: round(s * 1e3, 1) for r, s in sorted(proposer.cost.seconds.items())}
        same = tokens["off"] == tokens["on"]
        print(
            f"batch {count}: off {off:.2f} t/s, on {on:.2f} t/s, on / off {ratio:.3f} "
            f"(rounds {rounds}), same tokens {same}"
        )
        print(f"  step ms by rows: {costs}", file=sys.stderr)
        rows.append(
            {
                "batch": count,
                "tokens": total,
                "off_tps": off,
                "on_tps": on,
                "ratio": ratio,
                "rounds": rounds,
                "step_ms_by_rows": costs,
                "same_tokens": same,
            }  # fmt: skip
        )
    if args.json:
        meta = {"cpu": cpu_name(), "model": Path(args.model).name, "rounds": args.rounds,
                "max_tokens": args.max_tokens, "threads": args.threads}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
