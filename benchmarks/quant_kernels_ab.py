"""The quantized linear kernels of two builds of the native library in one process: the A/B
for a change to a kernel, on a machine too noisy for two runs one after the other.

Builds this checkout's library (B) and another checkout's (A, --base: a `git worktree` of the
commit to compare with), loads both, and streams the same random weights through each
(quant_kernels.py's passes: one decode step's projections of the --shape model, far past the
caches) at each number of input rows, the sides alternating pass by pass, --repeats passes
a side after a warm-up. Prints each side's median ms a pass, B / A, and whether both gave
the same bits (the last pass's outputs).

    .venv/bin/python benchmarks/quant_kernels_ab.py --base /path/to/worktree [--shape 1b]
        [--formats q4_k,q6_k] [--rows 1,2,3,4,5,6] [--int-dots on] [--isa avx2] [--threads 2]
        [--fused-rows 16] [--vnni-q4-k on] [--repeats 15] [--json OUT.json]

`--fused-rows N` sends batches of up to N rows through the fused kernels, as a speculative
step of N rows does (the default, 0, leaves the library's 8: larger batches take the panels
or tiles).
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
sys.path.insert(0, str(HERE / "benchmarks"))

from moe_layer_ab import library_path  # noqa: E402
from quant_kernels import MODEL_SHAPES, model_weights  # noqa: E402
from quant_vs_llamacpp import cpu_name  # noqa: E402

from pagecli_kernels import native, quant_cpu  # noqa: E402
from pagecli_kernels.settings import KernelSettings, apply  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--shape", default="1b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--formats", default="q4_k,q6_k")
    parser.add_argument("--rows", default="1,2,3,4,5,6")
    parser.add_argument("--int-dots", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--isa", default=None, help="portable, avx2 or avx512 (default: the CPU's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fused-rows", type=int, default=0)
    parser.add_argument(
        "--vnni-q4-k", default="auto", choices=["auto", "on", "off"], help="Q4_K on VNNI's kernels"
    )
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    libs = {"B": native.library()}
    libs["A"] = ctypes.CDLL(library_path(Path(args.base).resolve()))
    quant_cpu.library()  # B bound
    quant_cpu._bind(libs["A"])  # A: the same argument types
    hidden, intermediate = MODEL_SHAPES[args.shape][:2]
    rng = np.random.default_rng(0)
    results = []
    print(
        f"{cpu_name()}, {args.threads} threads, {args.shape} shapes, int_dots {args.int_dots}, "
        f"isa {args.isa or 'auto'}, fused_rows {args.fused_rows or 'default'}, "
        f"vnni_q4_k {args.vnni_q4_k}"
    )
    print(f"{'format':<7}{'rows':>5}{'A ms':>9}{'B ms':>9}{'B/A':>7}  same bits")
    for fmt in args.formats.split(","):
        weights = model_weights(fmt, args.shape, rng)
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in (hidden, intermediate)}
            calls, outs = {}, {}
            for side, lib in libs.items():
                native._state["lib"] = lib
                # apply() skips what the applied settings already say: the defaults first, so
                # that each side's library is told the chosen ones (else only B's was)
                apply(KernelSettings())
                apply(
                    KernelSettings(
                        int_dots=args.int_dots,
                        isa=args.isa or "auto",
                        fused_rows=args.fused_rows,
                        vnni_q4_k=args.vnni_q4_k,
                    )
                )
                assert lib.pagecli_quant_isa() == libs["B"].pagecli_quant_isa()
                calls[side] = [(quant_cpu.PreparedLinear(w), xs[w.cols]) for w in weights]
            times = {"A": [], "B": []}
            for repeat in range(args.repeats + 1):
                for side in ("A", "B") if repeat % 2 else ("B", "A"):
                    native._state["lib"] = libs[side]
                    start = time.perf_counter()
                    outs[side] = [prepared(x) for prepared, x in calls[side]]
                    if repeat:
                        times[side].append(time.perf_counter() - start)
            # bit patterns: random blocks may hold a NaN scale, and NaN != NaN
            same = all(
                torch.equal(a.view(torch.int32), b.view(torch.int32))
                for a, b in zip(outs["A"], outs["B"])
            )
            a, b = (statistics.median(times[s]) * 1e3 for s in ("A", "B"))
            print(f"{fmt:<7}{rows:>5}{a:>9.2f}{b:>9.2f}{b / a:>7.3f}  {same}")
            results.append({"format": fmt, "rows": rows, "a_ms": a, "b_ms": b, "same_bits": same})
    native._state["lib"] = libs["B"]
    if args.json:
        meta = {"cpu": cpu_name(), "threads": args.threads, "shape": args.shape,
                "int_dots": args.int_dots, "isa": args.isa or "auto",
                "fused_rows": args.fused_rows, "vnni_q4_k": args.vnni_q4_k,
                "repeats": args.repeats}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
