"""Batched decode with the integer path of Q4_K/Q6_K against the float kernels, in one process.

For each B in --batches: B prompts of --prompt token ids, greedy, `ignore_eos`; decode time is
a (T + 1)-token generation's minus a 1-token one's (as benchmarks/batched_decode.py counts
it), under each `--kernels int_dots` choice in turn (the sides alternate, so a shared
machine's drift moves both), --rounds times after a warm-up round; prints the median decode
tokens/s per choice and the rounds.

    .venv/bin/python benchmarks/int_dots_batches.py --model /tmp/pagecli-shaped/1b-q4_k_m.gguf \\
        [--batches 2,4,8] [--choices off,auto,on] [--prompt 32] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagecli import LLM, SamplingParams
from pagecli_kernels.settings import KernelSettings, apply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="2,4,8")
    parser.add_argument("--choices", default="off,auto")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(args.model, num_threads=args.threads)
    choices = args.choices.split(",")
    for batch in map(int, args.batches.split(",")):
        prompts = [
            {"prompt_token_ids": [100 + 7 * s + j for j in range(args.prompt)]}
            for s in range(batch)
        ]

        def seconds(n: int, prompts=prompts) -> float:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            start = time.perf_counter()
            llm.generate(prompts, params)
            return time.perf_counter() - start

        rates: dict[str, list[float]] = {c: [] for c in choices}
        for number in range(args.rounds + 1):
            for choice in choices:
                apply(KernelSettings(int_dots=choice))
                rate = batch * args.tokens / (seconds(args.tokens + 1) - seconds(1))
                if number:  # the first round warms up
                    rates[choice].append(rate)
        apply(KernelSettings())
        for choice in choices:
            each = ", ".join(f"{r:.1f}" for r in rates[choice])
            print(f"B={batch} int_dots={choice}: {statistics.median(rates[choice]):.1f} "
                  f"decode t/s ({each})")  # fmt: skip


if __name__ == "__main__":
    main()
