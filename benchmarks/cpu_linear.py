"""Time the default model's projections with plain and packed weights (a script, not a test).

The weights of all 30 layers of SmolLM2-135M (q/k/v, o, gate/up, down: about 424 MB in
float32) plus the 49152 x 576 output projection are multiplied in turn, as one forward pass
does, so they stream from memory as in the engine. `plain` is F.linear (MKL repacks each
weight per call), `packed` is pagecli.layers.linear.PackedLinear (packed once for oneDNN).
Median of several repetitions; rows are the tokens of the step (decode batch or prefill chunk).

    .venv/bin/python benchmarks/cpu_linear.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs

from pagecli.layers.linear import PackedLinear

HIDDEN, INTERMEDIATE, Q_KV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(Q_KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) for _ in range(LAYERS) for shape in SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen))
    packed = [PackedLinear(w, None) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"threads {args.threads}; {sum(w.numel() for w in weights) * 4 / 1e6:.0f} MB of weights")
    print(f"{'rows':>6}{'plain ms':>10}{'packed ms':>11}{'speed-up':>10}{'packed GFLOP/s':>16}")
    for rows in (1, 4, 16, 32, 64, 128, 256, 2048):
        inputs = {n: torch.randn(rows, n, generator=gen) for n in (HIDDEN, INTERMEDIATE)}

        def plain(inputs=inputs):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)

        def pack(inputs=inputs):
            for p in packed:
                p(inputs[p.in_features])

        plain_ms = median_ms(plain, args.repeats)
        packed_ms = median_ms(pack, args.repeats)
        rate = rows * flops_per_row / packed_ms / 1e6
        speedup = plain_ms / packed_ms
        print(f"{rows:>6}{plain_ms:>10.1f}{packed_ms:>11.1f}{speedup:>9.2f}x{rate:>16.1f}")


if __name__ == "__main__":
    main()
