"""One MoE layer call (`pagecli_moe`, the layer program's OP_MOE) from two builds of the native
library in one process: the A/B for a change to the expert dispatch.

Builds this checkout's library (B) and another checkout's (A, --base: a `git worktree` of the
commit to compare with; each is built from its own C sources into the user cache, as
benchmarks/ab_commits.py does), loads both, and calls each on the same layer: Qwen3-30B-A3B's
shape (hidden 2048, experts of 768, top 8; --experts of them, random, in Q4_K, the router
float32), T tokens at a time over 16 inputs, --rounds times, the sides alternating (so a
shared machine's drift moves both). Prints each side's median time a call, B / A, and checks
that both give the same bits.

    .venv/bin/python benchmarks/moe_layer_ab.py --base /path/to/worktree [--experts 64]
        [--tokens 1,4,8] [--threads 2] [--rounds 41] [--int-dots auto|on|off] [--json OUT.json]

--int-dots is the kernels' choice on both sides (engines of one sequence at a time run under
on; csrc/quant_k.c's Q4_K has other kernels there on AVX2).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from quant_vs_llamacpp import cpu_name  # noqa: E402

from pagecli.layers.moe import MoESpec, SparseMoE  # noqa: E402
from tests.kernels.test_moe_cpu import quantized_layer  # noqa: E402

HIDDEN, WIDTH, TOP_K = 2048, 768, 8


def library_path(checkout: Path) -> str:
    """The native library built from `checkout`'s sources (built now if it is not cached)."""
    code = "from pagecli_kernels import native; print(native.library()._name)"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # run in the checkout: `python -c` puts the working directory first on sys.path
    out = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE,
                         text=True, env=env, cwd=checkout).stdout  # fmt: skip
    return out.strip().splitlines()[-1]


def layer(experts: int) -> tuple[SparseMoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = SparseMoE(MoESpec(experts, TOP_K, WIDTH, norm_topk_prob=True), HIDDEN)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.05)
    for e in moe.experts:
        e.gate_up_proj = quantized_layer(e.gate_up_proj, "q4_k", [WIDTH, WIDTH])
        e.down_proj = quantized_layer(e.down_proj, "q4_k", [HIDDEN])
    moe.gate = quantized_layer(moe.gate, "float32", [experts])
    return moe, moe.native_table()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--int-dots", default="auto", choices=["auto", "off", "on"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    paths = {"A": library_path(Path(args.base).resolve()), "B": library_path(HERE)}
    libs = {side: ctypes.CDLL(path) for side, path in paths.items()}
    for lib in libs.values():
        lib.pagecli_moe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]  # fmt: skip
        if lib.pagecli_quant_set_int_dots(["auto", "off", "on"].index(args.int_dots)) != 0:
            raise SystemExit(f"moe_layer_ab: int_dots={args.int_dots} is refused here")
    moe, table = layer(args.experts)  # moe keeps the weights the table points at
    results = []
    for tokens in map(int, args.tokens.split(",")):
        gen = torch.Generator().manual_seed(tokens)
        inputs = [torch.randn(tokens, HIDDEN, generator=gen) for _ in range(16)]
        outs = {side: torch.empty(tokens, HIDDEN) for side in libs}
        times: dict[str, list[float]] = {side: [] for side in libs}
        for r in range(args.rounds + 1):
            order = list(libs.items()) if r % 2 == 0 else list(reversed(libs.items()))
            for side, lib in order:
                start = time.perf_counter()
                for x in inputs:
                    status = lib.pagecli_moe(table.data_ptr(), x.data_ptr(), tokens, HIDDEN,
                                             outs[side].data_ptr(), args.threads)  # fmt: skip
                    if status:
                        raise SystemExit(f"moe_layer_ab: side {side}: status {status}")
                if r:  # the first round warms up
                    times[side].append((time.perf_counter() - start) / len(inputs))
        same = torch.equal(outs["A"], outs["B"])
        a, b = (statistics.median(times[side]) for side in ("A", "B"))
        row = {"tokens": tokens, "A_us": a * 1e6, "B_us": b * 1e6, "B_over_A": b / a, "same": same}
        results.append(row)
        print(f"T={tokens}: A {a * 1e6:.0f} us, B {b * 1e6:.0f} us a call, B/A {b / a:.3f}, "
              f"same bits: {same}")  # fmt: skip
    print(f"CPU: {cpu_name()}; {args.threads} threads; {args.experts} experts of {WIDTH}, top "
          f"{TOP_K}, Q4_K, int_dots={args.int_dots}; A = {args.base}, B = {HERE}")  # fmt: skip
    del moe
    if args.json:
        record = {"cpu": cpu_name(), "threads": args.threads, "experts": args.experts,
                  "int_dots": args.int_dots,
                  "rounds": args.rounds, "libraries": paths, "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
