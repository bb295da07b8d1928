"""A draft model's drafts at temperature > 0: rejection sampling against sample-and-compare
(and no drafts), on the workloads of `pagecli bench --scenario spec`, in one process.

    .venv/bin/python benchmarks/spec_temperature.py TARGET.gguf --draft DRAFT.gguf
        [--temperature 0.8] [--top-p 0.95] [--draft-max 4] [--forced K] [--repetitions 3]
        [--max-tokens 96] [--num-prompts 2] [--threads 2] [--json OUT]

Each workload's requests run one at a time, without a seed (the engine's generator), under
each acceptance method of the speculative config (`acceptance_method`), and without drafts;
per workload and mode: the median decode rate (tokens/s after the first token), and the
drafts' acceptance rate and mean accepted length over all repetitions. The policy decides
how many drafts a step checks, as in use; with `--forced K` every decode step carries K
drafts whatever it says, so that the acceptance rates come from every step (the rates then
are those of K drafts a step). The three modes take turns within each repetition.

Prints one table to stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from pagecli import LLM, SamplingParams
from pagecli.bench.spec import workloads

MODES = ("off", "sample_and_compare", "rejection_sampler")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--draft-max", type=int, default=4)
    parser.add_argument("--forced", type=int, default=0, help="K drafts every step")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    spec = {"model": args.draft, "num_speculative_tokens": args.draft_max}
    llm = LLM(args.model, speculative_config=spec, num_threads=args.threads, max_num_seqs=1)
    engine = llm.engine
    proposer = engine.proposer
    if args.forced:
        proposer.allocate = lambda candidates, rows, tokens: [
            min(args.forced, len(rates)) for rates in candidates
        ]
    configs = {
        mode: dataclasses.replace(proposer.config, acceptance_method=mode) for mode in MODES[1:]
    }
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens
    )
    llm.generate([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4))  # warm
    counters = engine.scheduler.counters
    rows = []
    for name, prompts in workloads(args.num_prompts).items():
        rates = {mode: [] for mode in MODES}
        counts = {mode: [0, 0, 0] for mode in MODES}  # drafts, draft tokens, accepted
        for rep in range(args.repetitions):
            for mode in MODES:
                engine.proposer = None if mode == "off" else proposer
                if mode != "off":
                    proposer.config = configs[mode]
                before = (
                    counters.spec_drafts,
                    counters.spec_draft_tokens,
                    counters.spec_accepted_tokens,
                )
                generated, seconds = 0, 0.0
                for prompt in prompts:
                    start = time.perf_counter()
                    (out,) = llm.generate([prompt], params)
                    first = out.metrics.get("first_token_time", start)
                    seconds += time.perf_counter() - first
                    generated += max(len(out.token_ids) - 1, 0)
                rates[mode].append(generated / seconds if seconds else 0.0)
                counts[mode][0] += counters.spec_drafts - before[0]
                counts[mode][1] += counters.spec_draft_tokens - before[1]
                counts[mode][2] += counters.spec_accepted_tokens - before[2]
                print(f"{name} {mode} rep {rep}: {rates[mode][-1]:.2f} t/s", file=sys.stderr)
        engine.proposer = proposer
        row = {"workload": name}
        for mode in MODES:
            drafts, draft_tokens, accepted = counts[mode]
            row[mode] = {
                "decode_tokens_per_s": statistics.median(rates[mode]),
                "runs": rates[mode],
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None,
                "draft_tokens": draft_tokens,
            }
        rows.append(row)

    def fmt(value, pattern):
        return "-" if value is None else pattern.format(value)

    print(
        f"temperature {args.temperature}, top_p {args.top_p}, draft-max {args.draft_max}"
        + (f", {args.forced} drafts forced every step" if args.forced else ", the policy's k")
    )
    print("| workload | mode | decode t/s | accepted | tokens a checked step | draft tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        for mode in MODES:
            r = row[mode]
            print(
                f"| {row['workload']} | {mode} | {r['decode_tokens_per_s']:.2f} | "
                f"{fmt(r['acceptance_rate'], '{:.0%}')} | "
                f"{fmt(r['mean_accepted_length'], '{:.2f}')} | {r['draft_tokens']} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
