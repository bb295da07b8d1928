"""How far prompt lookup can take the spec scenario's workloads on this machine: the most any
drafts drawn from the sequence itself could gain, at the step costs measured here.

Three things, on one model and thread count:
1. each workload's greedy replies (`pagecli bench --scenario spec`'s prompts, no drafts);
2. the step cost by rows, c(r) for r = 1..9: one sequence decoding with r - 1 drafts forced
   into every step (drafts that are never accepted, so every step has r rows), median of the
   rounds;
3. replayed on the replies, for k = 1..8 drafts at most: tokens a step and the speed-up
   (each token's one-row step against the steps taken) of
   - `ngram`: pagecli's proposer (NgramIndex, prompt_lookup_min..max, the latest earlier
     occurrence of the longest suffix), drafting k whenever it matches;
   - `oracle`: at every step, of all earlier occurrences of every suffix of 1..max tokens,
     the one whose continuation the reply follows longest, drafting exactly the tokens that
     will be accepted (at most k). No proposer that copies from the context can do better
     without checking several continuations in one step (tree attention).
The oracle's best k bounds what prompt lookup can give a workload at these costs; the
engine's policy (engine/spec_decode/proposer.py) picks k per step from measured acceptance.
4. `policy`: the engine's own policy and n-gram proposer (NgramProposer: its acceptance
   estimates, back-off and `allocate`, at most `--draft-max` drafts) replayed on the same
   replies, the step costs it learns the measured c(r); `--max-cooldown A,B,...` replays it
   with other longest back-offs as well.
`--per-row-ms A,B,...` replays the same replies at what-if costs as well: the measured c(1)
plus that many milliseconds a further row (the FMA floor of a row is the model's
2 x parameters FLOPs over `benchmarks/fma_peak.py`'s rate), to say how cheap verify rows
must be for a workload's target.

    .venv/bin/python benchmarks/spec_lookup_bound.py MODEL.gguf [--threads 2]
        [--num-prompts 2] [--max-tokens 96] [--rounds 3] [--kernels NAME=VALUE,...]
        [--per-row-ms 4,6.5,9] [--draft-max 5] [--max-cooldown 8,32] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

from pagecli.bench.spec import workloads
from pagecli.config import SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch, ScheduledSeq
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.engine.spec_decode.ngram import NgramIndex
from pagecli.engine.spec_decode.proposer import NgramProposer
from pagecli.llm import LLM
from pagecli.sampling_params import SamplingParams

MOST_ROWS = 9


def replies(llm: LLM, num_prompts: int, max_tokens: int) -> dict[str, list[tuple]]:
    """Each workload's (prompt ids, greedy reply ids), with speculation off."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = {}
    for name, prompts in workloads(num_prompts).items():
        done = llm.generate(prompts, params)
        out[name] = [(r.prompt_token_ids, list(r.token_ids)) for r in done]
    return out


def step_costs(llm: LLM, rounds: int, steps: int = 16) -> dict[int, float]:
    """c(r), seconds, r = 1..MOST_ROWS: every step of a greedy decode given r - 1 drafts (the
    last token repeated: rejected nearly always, so the step keeps its r rows)."""
    proposer = llm.engine.proposer
    forced = {"k": 0}
    proposer.drafts = lambda seq, k: [seq.token_ids[-1]] * k
    proposer.allocate = lambda candidates, rows, tokens: [forced["k"] for _ in candidates]
    prompt = workloads(1)["chat"][0]
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    seen: dict[int, list[float]] = {}
    for _ in range(rounds):
        for rows in range(1, MOST_ROWS + 1):
            forced["k"] = rows - 1
            proposer.cost.seconds.clear()
            start = time.perf_counter()
            llm.generate([prompt], params)
            per_step = proposer.cost.seconds.get(rows)
            if per_step is None:  # no step of that many rows (the prompt ran out): wall time
                per_step = (time.perf_counter() - start) / steps
            seen.setdefault(rows, []).append(per_step)
    return {rows: statistics.median(values) for rows, values in seen.items()}


def _accepted(drafts: list[int], rest: list[int]) -> int:
    n = 0
    while n < len(drafts) and n < len(rest) and drafts[n] == rest[n]:
        n += 1
    return n


def _oracle(seq: list[int], rest: list[int], k: int, most_n: int) -> int:
    """The longest continuation, at most k, that the reply follows after any earlier
    occurrence of any suffix of 1..most_n tokens."""
    best = 0
    length = len(seq)
    for n in range(1, min(most_n, length - 1) + 1):
        suffix = seq[length - n :]
        for start in range(length - n):
            if seq[start : start + n] == suffix:
                best = max(best, _accepted(seq[start + n : start + n + k], rest))
                if best == k:
                    return k
    return best


def replay(pairs: list[tuple], k: int, costs: dict[int, float], min_n: int, max_n: int) -> dict:
    """Tokens a step and speed-up of the n-gram proposer and the oracle at k drafts at most."""
    result = {}
    for mode in ("ngram", "oracle"):
        tokens = steps = 0
        seconds = 0.0
        for prompt, reply in pairs:
            index = NgramIndex(min_n, max_n)
            seq = list(prompt)
            i = 0
            while i < len(reply):
                if mode == "ngram":
                    drafts = index.propose(seq, k)
                    accepted = _accepted(drafts, reply[i:])
                    rows = 1 + len(drafts)
                else:
                    accepted = _oracle(seq, reply[i:], k, max_n)
                    rows = 1 + accepted
                emitted = min(accepted + 1, len(reply) - i)
                seq += reply[i : i + emitted]
                i += emitted
                steps += 1
                seconds += costs[rows]
            tokens += len(reply)
        result[mode] = {
            "tokens_per_step": tokens / steps,
            "speedup": tokens * costs[1] / seconds,
        }
    return result


def policy_replay(
    pairs: list[tuple],
    costs: dict[int, float],
    config: SpeculativeConfig,
    max_cooldown: int,
    token_text=None,
    special=None,
) -> dict:
    """The engine's policy and n-gram proposer on the replies: each reply decoded from its
    first token (the prefill's) on, one sequence at a time as in the spec scenario, each
    step's drafts those the policy asks for, checked against the reply, its time c(rows)
    (which the policy learns as it would in the engine; `token_text` and `special` the
    engine's, for the kinds of its drafts and where a copy stops)."""
    proposer = NgramProposer(config, token_text, special)
    proposer.max_cooldown = max_cooldown
    tokens = steps = drafted = accepted_all = 0
    seconds = base = 0.0
    for number, (prompt, reply) in enumerate(pairs):
        params = SamplingParams(temperature=0, max_tokens=len(reply))
        seq = Sequence(number, f"r{number}", list(prompt) + reply[:1], len(prompt), params, 10**6)
        seq.status = SequenceStatus.RUNNING
        i = 1
        while i < len(reply):
            seq.num_computed_tokens = len(seq.token_ids) - 1
            seq.draft_token_ids = []
            proposer.propose([seq])
            drafts = seq.draft_token_ids
            accepted = _accepted(drafts, reply[i:])
            emitted = min(accepted + 1, len(reply) - i)
            rows = 1 + len(drafts)
            item = ScheduledSeq(seq, rows, list(drafts))
            sampled = SampledTokens(reply[i : i + emitted], num_accepted=accepted)
            proposer.observe(ScheduledBatch(decodes=[item]), [sampled], costs[rows])
            seq.token_ids += reply[i : i + emitted]
            i += emitted
            steps += 1
            seconds += costs[rows]
            drafted += len(drafts)
            accepted_all += accepted
        tokens += len(reply) - 1
        base += (len(reply) - 1) * costs[1]
    return {
        "tokens_per_step": tokens / steps if steps else 0.0,
        "speedup": base / seconds if seconds else 0.0,
        "acceptance": accepted_all / drafted if drafted else 0.0,
    }


def best_of_k(pairs: list[tuple], costs: dict[int, float], min_n: int, max_n: int):
    """replay() at every k, and the k with the best speed-up of each mode."""
    by_k = {k: replay(pairs, k, costs, min_n, max_n) for k in range(1, MOST_ROWS)}
    best = {
        mode: max(by_k, key=lambda k, mode=mode: by_k[k][mode]["speedup"])
        for mode in ("ngram", "oracle")
    }
    return by_k, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kernels", default="", help="the CPU kernels' choices, as --kernels")
    parser.add_argument(
        "--per-row-ms", default="", help="what-if costs: c(1) plus this many ms a further row"
    )
    parser.add_argument("--draft-max", type=int, default=SpeculativeConfig.num_speculative_tokens)
    parser.add_argument(
        "--max-cooldown",
        default=str(NgramProposer.max_cooldown),
        help="the policy replay's longest back-offs, in steps",
    )
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    llm = LLM(
        args.model,
        num_threads=args.threads,
        kernels=args.kernels,
        max_num_seqs=1,
        speculative_config={"method": "ngram", "num_speculative_tokens": MOST_ROWS - 1},
    )
    config = llm.engine.config.speculative_config
    proposer, llm.engine.proposer = llm.engine.proposer, None
    pairs = replies(llm, args.num_prompts, args.max_tokens)
    llm.engine.proposer = proposer
    costs = step_costs(llm, args.rounds)
    curve = ", ".join(f"{rows}: {1000 * s:.1f}" for rows, s in sorted(costs.items()))
    print(f"step ms by rows: {curve}", file=sys.stderr)
    print(
        "| workload | n-gram: best k, tokens a step, speed-up "
        "| oracle: best k, tokens a step, speed-up |",
        file=sys.stderr,
    )
    lookup = (config.prompt_lookup_min, config.prompt_lookup_max)
    rows_out = []
    for name, workload_pairs in pairs.items():
        by_k, best = best_of_k(workload_pairs, costs, *lookup)
        cells = [
            f"{best[m]}, {by_k[best[m]][m]['tokens_per_step']:.2f}, "
            f"{by_k[best[m]][m]['speedup']:.2f}x"
            for m in ("ngram", "oracle")
        ]
        print(f"| {name} | {cells[0]} | {cells[1]} |", file=sys.stderr)
        rows_out.append({"workload": name, "by_k": by_k, "best_k": best})
    replayed = dataclasses.replace(config, num_speculative_tokens=args.draft_max)
    policy = []
    for cooldown in [int(v) for v in args.max_cooldown.split(",") if v]:
        row = {"max_cooldown": cooldown, "workloads": {}}
        for name, workload_pairs in pairs.items():
            row["workloads"][name] = policy_replay(
                workload_pairs, costs, replayed, cooldown, proposer.token_text, proposer.special
            )
        cells = ", ".join(
            f"{name} {v['speedup']:.2f}x ({v['acceptance']:.0%})"
            for name, v in row["workloads"].items()
        )
        print(f"policy, back-off at most {cooldown} steps: {cells}", file=sys.stderr)
        policy.append(row)
    what_if = []
    for per_row in [float(v) for v in args.per_row_ms.split(",") if v]:
        linear = {r: costs[1] + per_row / 1000 * (r - 1) for r in costs}
        row = {"per_row_ms": per_row, "workloads": {}}
        for name, workload_pairs in pairs.items():
            by_k, best = best_of_k(workload_pairs, linear, *lookup)
            row["workloads"][name] = {m: by_k[best[m]][m]["speedup"] for m in best}
        cells = ", ".join(
            f"{name} {v['ngram']:.2f}x / {v['oracle']:.2f}x" for name, v in row["workloads"].items()
        )
        print(f"{per_row} ms a further row (n-gram / oracle): {cells}", file=sys.stderr)
        what_if.append(row)
    result = {
        "model": args.model,
        "threads": args.threads,
        "args": vars(args),
        "prompt_lookup": [config.prompt_lookup_min, config.prompt_lookup_max],
        "step_seconds_by_rows": costs,
        "workloads": rows_out,
        "what_if_per_row": what_if,
        "policy": policy,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
