"""A chat's second turn on a hybrid model: time to first token with the first turn's cache
(window tables, recurrent-state snapshots) against a cold prefill of the same prompt, and the
KV the engine holds.

Turn one is a random prompt of --turn1 token ids and a greedy reply of --reply tokens; turn
two is turn one's prompt and reply followed by --turn2 more ids. "warm" sends turn two to the
engine that ran turn one; "cold" sends it to an engine with prefix caching off (after a short
warm-up request, so that neither pays for start-up). Each round uses fresh engines; prints the
median TTFTs, their ratio, whether the first --check tokens agree, and the engine's blocks per
KV table and state slots, with the CPU named.

    .venv/bin/python benchmarks/hybrid_reuse.py --model FILE.gguf|FOLDER [--dummy]
        [--turn1 1024] [--reply 32] [--turn2 64] [--rounds 3] [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from quant_vs_llamacpp import cpu_name  # benchmarks/ is on sys.path when a script here runs

from pagecli import LLM, SamplingParams


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, min(vocab, 30000)) for _ in range(n)]


def ttft(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the first `tokens` ids, prompt tokens found cached)."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    return out.metrics["time_to_first_token"], out.token_ids, out.num_cached_tokens


def one_round(args, seed: int) -> dict:
    options = {"num_threads": args.threads, "max_num_seqs": 8}
    if args.dummy:
        options["load_format"] = "dummy"
    rng = random.Random(seed)
    warm = LLM(args.model, **options)
    vocab = warm.engine.hf_config.vocab_size
    first = ids(rng, args.turn1, vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.reply, ignore_eos=True)
    (reply,) = warm.generate([{"prompt_token_ids": first}], params)
    second = first + reply.token_ids + ids(rng, args.turn2, vocab)
    warm_s, warm_ids, cached = ttft(warm, second, args.check)
    stats = warm.engine.stats()
    layout = {
        "memory_line": warm.engine.runner.memory.line(),
        "kv_groups": list(stats.kv_groups),
        "group_blocks_in_use_after": list(stats.group_blocks_in_use),
        "window_freed_blocks": stats.window_freed_blocks,
        "state_snapshots_saved": stats.state_snapshots_saved,
    }
    del warm
    cold = LLM(args.model, enable_prefix_caching=False, **options)
    ttft(cold, ids(rng, 16, vocab), 1)  # warm-up: libraries, kernels, buffers
    cold_s, cold_ids, _ = ttft(cold, second, args.check)
    del cold
    return {
        "warm_ttft_s": warm_s,
        "cold_ttft_s": cold_s,
        "speedup": cold_s / warm_s,
        "cached_tokens": cached,
        "prompt_tokens": len(second),
        "same_tokens": warm_ids == cold_ids,
        **layout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dummy", action="store_true", help="a config folder: random weights")
    parser.add_argument("--turn1", type=int, default=1024)
    parser.add_argument("--reply", type=int, default=32)
    parser.add_argument("--turn2", type=int, default=64)
    parser.add_argument("--check", type=int, default=8, help="tokens compared warm vs cold")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rounds = [one_round(args, seed) for seed in range(args.rounds)]
    summary = {
        "cpu": cpu_name(),
        "model": args.model,
        "threads": args.threads,
        "turn1": args.turn1,
        "reply": args.reply,
        "turn2": args.turn2,
        "warm_ttft_s_median": statistics.median(r["warm_ttft_s"] for r in rounds),
        "cold_ttft_s_median": statistics.median(r["cold_ttft_s"] for r in rounds),
        "speedup_median": statistics.median(r["speedup"] for r in rounds),
        "all_same_tokens": all(r["same_tokens"] for r in rounds),
        "rounds": rounds,
    }
    print(
        f"{summary['cpu']}, {args.threads} threads, {Path(args.model).name}: second turn of "
        f"{rounds[0]['prompt_tokens']} tokens ({rounds[0]['cached_tokens']} cached): TTFT warm "
        f"{summary['warm_ttft_s_median'] * 1000:.1f} ms, cold "
        f"{summary['cold_ttft_s_median'] * 1000:.1f} ms, {summary['speedup_median']:.1f}x; "
        f"same tokens: {summary['all_same_tokens']}",
        file=sys.stderr,
    )
    print(f"  {rounds[0]['memory_line']}", file=sys.stderr)
    text = json.dumps(summary, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
