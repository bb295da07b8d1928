"""Decode of B parallel sequences, pagecli against llama.cpp's `llama-batched-bench`.

For each B in --batches, --rounds times, the two engines in turn: llama.cpp's
`llama-batched-bench -npp P -ntg T -npl B` (its S_TG: generated tokens per second of the
decode phase), and pagecli in this process on the same file: B prompts of P token ids, greedy,
`ignore_eos`; its decode time is a (T + 1)-token generation's time minus a 1-token
generation's (the prefill and the first token), so both figures count T decode steps of B
sequences. Prints the median round's tokens/s and the median of the rounds' ratios, with the
FLOPs floor of a step beside them: B x (2 x the layer matrices' and the output projection's
weights) / the float32 FMA peak (benchmarks/fma_peak.py); attention's work is left out
(about 3% at these lengths on a 1B shape).

    .venv/bin/python benchmarks/batched_decode.py --model /tmp/pagecli-shaped/1b-q4_k_m.gguf \\
        [--batches 1,4,8,16] [--prompt 32] [--tokens 32] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from fma_peak import fma_peak
from quant_vs_llamacpp import PEERS, cpu_name, run
from shaped_gguf import decode_macs

from pagecli import LLM, SamplingParams


def llama_decode(model: str, threads: int, prompt: int, tokens: int, batch: int) -> float:
    out = run(
        [str(PEERS / "bin" / "llama-batched-bench"), "-m", model, "-t", str(threads),
         "-c", str(batch * (prompt + tokens) + 64), "-b", "2048", "-ub", "512",
         "-npp", str(prompt), "-ntg", str(tokens), "-npl", str(batch),
         "--output-format", "jsonl"]
    )  # fmt: skip
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


def pagecli_decode(llm: LLM, prompt: int, tokens: int, batch: int) -> float:
    prompts = [
        {"prompt_token_ids": [(s * 7919 + j * 104729) % 40000 + 100 for j in range(prompt)]}
        for s in range(batch)
    ]

    def seconds(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    return batch * tokens / (seconds(tokens + 1) - seconds(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, num_threads=args.threads)
    pagecli_decode(llm, args.prompt, 2, 2)  # warm the kernels and the allocator
    macs = decode_macs(Path(args.model))
    found: dict[int, list[dict]] = {b: [] for b in batches}
    for number in range(args.rounds):
        peak = fma_peak(args.threads)
        for batch in batches:
            row = {"fma_peak_gflop_s": peak / 1e9, "floor_ms": 1000 * batch * 2 * macs / peak}
            engines = [
                ("pagecli", lambda b=batch: pagecli_decode(llm, args.prompt, args.tokens, b)),
                ("llama.cpp", lambda b=batch: llama_decode(
                    args.model, args.threads, args.prompt, args.tokens, b)),
            ]  # fmt: skip
            for name, fn in engines if number % 2 == 0 else engines[::-1]:
                row[name] = fn()
            row["ratio"] = row["pagecli"] / row["llama.cpp"]
            print(f"pagecli: batched_decode: round {number}: B={batch}: {json.dumps(row)}",
                  file=sys.stderr)  # fmt: skip
            found[batch].append(row)
    print(f"CPU: {cpu_name()}; {args.threads} threads; {args.model}; prompts of {args.prompt}, "
          f"{args.tokens} decode steps; medians of {args.rounds} rounds")  # fmt: skip
    print("| B | pagecli decode t/s | llama.cpp S_TG t/s | ratio (rounds) | pagecli ms/step | "
          "FLOPs floor ms/step |")  # fmt: skip
    print("| --- " * 6 + "|")
    for batch, rows in found.items():
        ours = statistics.median(r["pagecli"] for r in rows)
        theirs = statistics.median(r["llama.cpp"] for r in rows)
        ratios = [r["ratio"] for r in rows]
        each = ", ".join(f"{v:.2f}" for v in ratios)
        floor = statistics.median(r["floor_ms"] for r in rows)
        print(f"| {batch} | {ours:.1f} | {theirs:.1f} | {statistics.median(ratios):.2f}x ({each}) "
              f"| {1000 * batch / ours:.1f} | {floor:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
