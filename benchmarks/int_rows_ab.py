"""One quantized product at 1-5 input rows (`pagecli_quant_linear`) from two builds of the
native library in one process: the A/B for a change to a fused or integer kernel.

Builds this checkout's library (B) and another checkout's (A, --base: a `git worktree` of the
commit to compare with; each from its own C sources, as benchmarks/moe_layer_ab.py does),
loads both, and multiplies one random matrix of --format (quant_kernels.random_weight; --n x
--k, in the L3 at the default 2048 x 2048) with m random input rows, m = 1..--rows, on
--threads threads under --int-dots, 20 calls a round, --rounds rounds, the sides
alternating. Prints each side's median time a call, its time over its own one-row call, and
B / A.

    .venv/bin/python benchmarks/int_rows_ab.py --base /path/to/worktree [--format q4_k]
        [--int-dots auto|on|off] [--threads 1] [--rows 5] [--rounds 31] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from moe_layer_ab import library_path  # noqa: E402
from quant_kernels import random_weight  # noqa: E402
from quant_vs_llamacpp import cpu_name  # noqa: E402

from pagecli_kernels.quant_formats import FORMATS  # noqa: E402

INT_DOTS = {"auto": 0, "off": 1, "on": 2}  # csrc/quant_linear_cpu.c's INT_AUTO, INT_OFF, INT_ON


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--format", default="q4_k", choices=sorted(FORMATS))
    parser.add_argument("--int-dots", default="on", choices=sorted(INT_DOTS))
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    paths = {"A": library_path(Path(args.base).resolve()), "B": library_path(HERE)}
    libs = {side: ctypes.CDLL(path) for side, path in paths.items()}
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for side, lib in libs.items():
        lib.pagecli_quant_linear.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ptr,
                                             i64, ctypes.c_int]  # fmt: skip
        if lib.pagecli_quant_set_int_dots(INT_DOTS[args.int_dots]) != 0:
            raise SystemExit(f"int_rows_ab: side {side} refuses int_dots={args.int_dots}")
    fmt = FORMATS[args.format]
    w = random_weight(args.format, args.n, args.k, np.random.default_rng(0)).data
    counts = range(1, args.rows + 1)
    times: dict[tuple[str, int], list[float]] = {(s, m): [] for s in libs for m in counts}
    outs: dict[tuple[str, int], torch.Tensor] = {}
    for r in range(args.rounds + 1):
        for m in counts:
            x = torch.randn(m, args.k, generator=torch.Generator().manual_seed(m))
            order = list(libs.items()) if r % 2 else list(reversed(libs.items()))
            for side, lib in order:
                y = torch.empty(m, args.n)
                call = (fmt.ggml_type, w.data_ptr(), args.n, args.k, x.data_ptr(), args.k, m,
                        y.data_ptr(), args.n, args.threads)  # fmt: skip
                start = time.perf_counter()
                for _ in range(20):
                    status = lib.pagecli_quant_linear(*call)
                    if status:
                        raise SystemExit(f"int_rows_ab: side {side}: status {status}")
                if r:  # the first round warms up
                    times[(side, m)].append((time.perf_counter() - start) / 20)
                outs[(side, m)] = y
    results = []
    for m in counts:
        a, b = (statistics.median(times[(s, m)]) for s in "AB")
        a1, b1 = (statistics.median(times[(s, 1)]) for s in "AB")
        same = torch.equal(outs[("A", m)], outs[("B", m)])
        results.append({"rows": m, "A_us": a * 1e6, "B_us": b * 1e6, "A_of_one_row": a / a1,
                        "B_of_one_row": b / b1, "B_over_A": b / a, "same": same})  # fmt: skip
        print(f"m={m}: A {a * 1e6:.0f} us ({a / a1:.2f} of 1 row), B {b * 1e6:.0f} us "
              f"({b / b1:.2f} of 1 row), B/A {b / a:.3f}, same bits: {same}")  # fmt: skip
    print(f"CPU: {cpu_name()}; {args.threads} threads; {args.format} {args.n} x {args.k}, "
          f"int_dots={args.int_dots}; A = {args.base}, B = {HERE}")  # fmt: skip
    if args.json:
        record = {"cpu": cpu_name(), "format": args.format, "n": args.n, "k": args.k,
                  "int_dots": args.int_dots, "threads": args.threads, "rounds": args.rounds,
                  "libraries": paths, "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
