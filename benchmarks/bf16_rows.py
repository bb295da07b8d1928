"""bfloat16 products of a few rows: torch's F.linear against the native row kernels (a script).

For the default model's projection shapes (gate/up, down, q/k/v, the tied head) and 1, 2, 4,
8 and 16 input rows, the median time of `F.linear` on bfloat16 tensors (oneDNN) and of
`BF16Linear`'s row kernels (float32 input, float32 sums, the output rounded to bfloat16),
with the weight bytes each read per microsecond. `BF16Linear.SMALL_ROWS` is where the row
kernels stop winning. Weights smaller than the caches run hot here, so their GB/s are cache
rates, not memory rates; the head's 57 MB is the one that streams from memory.

    .venv/bin/python benchmarks/bf16_rows.py [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs

from pagecli_kernels import quant_cpu
from pagecli_kernels.quant_formats import float_rows

SHAPES = [(3072, 576, "gate_up"), (576, 1536, "down"), (960, 576, "qkv"), (49152, 576, "head")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'layer':<8}{'N x K':>12}{'rows':>5}{'torch us':>10}{'rows us':>9}{'GB/s':>7}")
    for n, k, name in SHAPES:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(n, k, generator=gen).bfloat16()
        kernel = quant_cpu.PreparedLinear(float_rows(weight))
        for rows in (1, 2, 4, 8, 16):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            ours = median_ms(lambda x=x, kernel=kernel: kernel(x.float()).bfloat16(), 50) * 1e3
            theirs = median_ms(lambda x=x, weight=weight: F.linear(x, weight), 50) * 1e3
            print(
                f"{name:<8}{f'{n}x{k}':>12}{rows:>5}{theirs:>10.0f}{ours:>9.0f}"
                f"{n * k * 2 / ours / 1e3:>7.1f}"
            )


if __name__ == "__main__":
    main()
