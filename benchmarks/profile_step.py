"""Where the engine's CPU step time goes: attention ops versus the rest, at ~512-token contexts.

Runs a decode-heavy workload on the default model (32 requests with 512-token prompts, 64 new
tokens each) under torch's profiler and prints the share of time spent in the paged attention
ops (store_kv, paged_decode_attention, paged_prefill_attention) against the whole run.

    .venv/bin/python benchmarks/profile_step.py [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

import pagecli_kernels
from pagecli import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(None, dtype="float32", num_threads=args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    spent = {"attention": 0.0}
    originals = {}
    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention"):
        original = getattr(pagecli_kernels, name)
        originals[name] = original

        def timed(*a, _f=original, **kw):
            start = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                spent["attention"] += time.perf_counter() - start

        setattr(pagecli_kernels, name, timed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    for name, original in originals.items():
        setattr(pagecli_kernels, name, original)
    stats = llm.engine.stats()
    tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"threads {torch.get_num_threads()}: {args.num_prompts} x {args.prompt_len} prompt tokens, "
        f"{tokens} output tokens, {stats.num_steps} steps, wall {wall:.1f} s"
    )
    print(
        f"attention ops: {spent['attention']:.1f} s = {100 * spent['attention'] / wall:.0f}% "
        "of the run (the rest: linear layers, norms, rotary, sampling, scheduling)"
    )


if __name__ == "__main__":
    main()
