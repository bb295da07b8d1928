"""bfloat16 products: torch's F.linear against the native kernels, by input rows (a script).

For the default model's projection shapes (gate/up, down, q/k/v, the tied head) and 1 to 512
input rows, the median time of `F.linear` on bfloat16 tensors (oneDNN) and of
`quant_cpu.bf16_linear` (what `BF16Linear` runs: the row kernels up to
`quant_cpu.fused_rows()` rows, larger batches on the GEMM that `--bf16-gemm` names, by
default the CPU's choice; float32 sums, the output rounded to bfloat16), with the weight bytes
each read per microsecond and the native side's GFLOP/s. Weights smaller than the caches run
hot here, so their GB/s are cache rates, not memory rates; the head's 57 MB is the one that
streams from memory.

    .venv/bin/python benchmarks/bf16_rows.py [--threads 2] [--rows 1,2,4,8,16,64,512]
        [--bf16-gemm auto|off|pairs|tiles|float32]
"""

from __future__ import annotations

import argparse
import platform

import torch
import torch.nn.functional as F
from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs

from pagecli.engine.cpu_threads import cpu_model
from pagecli_kernels import quant_cpu
from pagecli_kernels.quant_formats import float_rows
from pagecli_kernels.settings import CHOICES, kernel_settings

SHAPES = [(3072, 576, "gate_up"), (576, 1536, "down"), (960, 576, "qkv"), (49152, 576, "head")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16,64,512")
    parser.add_argument("--bf16-gemm", default="auto", choices=CHOICES["bf16_gemm"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with kernel_settings(bf16_gemm=args.bf16_gemm):
        print(
            f"CPU: {cpu_model(platform.processor())}; {quant_cpu.isa()}; {args.threads} "
            f"threads; bf16_gemm {quant_cpu.bf16_gemm()}; row kernels up to "
            f"{quant_cpu.fused_rows()} rows"
        )
        print(
            f"{'layer':<8}{'N x K':>12}{'rows':>5}{'torch us':>10}{'native us':>10}"
            f"{'x torch':>8}{'GB/s':>7}{'GFLOP/s':>8}"
        )
        for n, k, name in SHAPES:
            gen = torch.Generator().manual_seed(0)
            weight = torch.randn(n, k, generator=gen).bfloat16()
            rows_weight = float_rows(weight)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen).bfloat16()
                reps = 50 if rows * n * k < 2**28 else 7

                def ours(x=x, w=rows_weight):
                    return quant_cpu.bf16_linear(x, w).bfloat16()

                def theirs(x=x, weight=weight):
                    return F.linear(x, weight)

                native, torch_us = median_ms(ours, reps) * 1e3, median_ms(theirs, reps) * 1e3
                print(
                    f"{name:<8}{f'{n}x{k}':>12}{rows:>5}{torch_us:>10.0f}{native:>10.0f}"
                    f"{torch_us / native:>8.2f}{n * k * 2 / native / 1e3:>7.1f}"
                    f"{2 * rows * n * k / native / 1e3:>8.1f}"
                )


if __name__ == "__main__":
    main()
