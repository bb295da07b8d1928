"""The single-stream decode floor: bytes of weights read per token / measured read bandwidth.

Loads a model as the engine does (default: the default model's GGUF, kept quantized), sums
the bytes one decode step must stream (every projection's weights, plus the output
projection: the whole tied embedding; one embedding row is negligible), and then, --rounds
times, measures this machine's memory read bandwidth with the same thread count (the best of
several passes of a streaming sum over a buffer far larger than the caches) right before the
single-stream decode time (a 128-token greedy generation after a 1-token prompt). Each
round's ratio compares figures taken seconds apart, so a shared machine's drift (neighbours
come and go within minutes) moves both; the report is the median round.

    .venv/bin/python benchmarks/decode_floor.py [--model FILE.gguf] [--threads 2]
        [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagecli import LLM, SamplingParams
from pagecli.bench.floor import read_bandwidth
from pagecli.models.weight_methods import decode_bytes


def bytes_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads (pagecli's own count: every projection, a mixture
    of experts' chosen share, the output projection, an embedding row)."""
    return decode_bytes(model)[1]


def decode_ms_per_token(llm: LLM, first_id: int, num_tokens: int = 128) -> float:
    """Mean time per generated token of one greedy stream after the 1-token prompt
    `first_id`."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": [first_id]}], params)
    return 1000 * (time.perf_counter() - start) / num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    llm = LLM(args.model, num_threads=args.threads, quantization=args.quantization)
    weight_bytes = bytes_per_token(llm.engine.runner.model)
    decode_ms_per_token(llm, 1, 16)  # warm
    rounds = []
    for i in range(args.rounds):
        bandwidth = read_bandwidth(args.threads)
        decode_ms = decode_ms_per_token(llm, 2 + i)
        floor_ms = 1000 * weight_bytes / bandwidth
        rounds.append((decode_ms / floor_ms, bandwidth, decode_ms, floor_ms))
    ratio, bandwidth, decode_ms, floor_ms = sorted(rounds)[len(rounds) // 2]  # median round
    result = {
        "threads": args.threads,
        "weight_bytes_per_token": weight_bytes,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms_per_token": floor_ms,
        "decode_ms_per_token": decode_ms,
        "decode_over_floor": ratio,
        "rounds": [
            {"decode_over_floor": r, "read_bandwidth_gb_s": b / 1e9, "decode_ms_per_token": d}
            for r, b, d, _ in rounds
        ],
        "median_decode_ms_per_token": statistics.median(r[2] for r in rounds),
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"threads {args.threads}: {weight_bytes / 1e6:.1f} MB of weights per token, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s -> floor {floor_ms:.2f} ms/token; "
        f"measured decode {decode_ms:.2f} ms/token = {ratio:.2f}x the floor (the median of "
        f"{args.rounds} rounds: " + ", ".join(f"{r[0]:.2f}x" for r in rounds) + ")"
    )


if __name__ == "__main__":
    main()
