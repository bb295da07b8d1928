"""Batch-1 products through builds of the native library side by side (a script).

Each variant is the library built from this checkout's csrc/ with extra compiler flags
(`-DWIDE_ROWS=1`), or from another commit's csrc/ (`@HEAD~1`); all are loaded into one
process and stream the default model's 30 layers of projections and its output projection
(`--shape 1b` or `8b`: Llama-3.2-1B's or Llama-3-8B's; random weights of each format, or
random float32/bfloat16 rows) at batch 1, the variants alternating pass by pass, so that all
of them see the same neighbours. Prints the median
GB/s of weights read per variant, and whether every variant's results equal the first's.

    .venv/bin/python benchmarks/kernel_variants.py --variants @HEAD~1,. \\
        --formats float32,bfloat16,q8_0,q4_1
    .venv/bin/python benchmarks/kernel_variants.py --variants -DWIDE_ROWS=2,-DWIDE_ROWS=4

A variant "." is this checkout as it is. Absolute rates here run below
benchmarks/quant_kernels.py's (the weights are not on huge pages, and several formats'
weights share the memory); compare the variants with each other only.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from quant_kernels import MODEL_SHAPES, model_weights

from pagecli_kernels import native
from pagecli_kernels.quant_formats import QuantWeight, float_rows

ROOT = Path(__file__).resolve().parents[1]


def build(variant: str, scratch: Path) -> ctypes.CDLL:
    """The library of one variant: "." (this checkout), "@REV" (a commit), or "-D..." flags."""
    root, flags = native.CSRC, []
    if variant.startswith("@"):
        root = scratch / variant[1:].replace("/", "_").replace("~", "_")
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", variant[1:], "pagecli_kernels/csrc"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        root = root / "pagecli_kernels" / "csrc"
    elif variant != ".":
        flags = [variant]
    sources = [root / native.SOURCE.name]
    sources += [root / p.name for p in native.EXTRA_SOURCES if (root / p.name).exists()]
    tag = "".join(c if c.isalnum() else "_" for c in variant)
    lib = native.build_and_load(f"variant_{tag}", sources, [*native.FLAGS, f"-I{root}", *flags])
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.pagecli_quant_linear.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.pagecli_quant_linear.restype = i32
    return lib


def weights_of(fmt: str, model: str, rng: np.random.Generator) -> list[QuantWeight]:
    hidden, intermediate, q_kv, vocab, layers = MODEL_SHAPES[model]
    layer = [(q_kv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    shapes = [shape for _ in range(layers) for shape in layer] + [(vocab, hidden)]
    if fmt in ("float32", "bfloat16"):
        dtype = getattr(torch, fmt)
        return [float_rows(torch.randn(n, k).to(dtype)) for n, k in shapes]
    return model_weights(fmt, model, rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="@HEAD~1,.")
    parser.add_argument("--formats", default="float32,bfloat16,q8_0,q4_1")
    parser.add_argument("--passes", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", default="default", choices=sorted(MODEL_SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    with tempfile.TemporaryDirectory() as scratch:
        libs = {name: build(name, Path(scratch)) for name in names}
    rng = np.random.default_rng(0)
    for fmt in args.formats.split(","):
        weights = weights_of(fmt, args.shape, rng)
        total = sum(w.nbytes for w in weights)
        xs = {k: torch.randn(1, k) for k in {w.cols for w in weights}}  # [1, K]
        outs = {name: [torch.empty(1, w.rows) for w in weights] for name in names}
        times: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(args.passes + 1):
            for name, lib in libs.items():
                start = time.perf_counter()
                for w, y in zip(weights, outs[name], strict=True):
                    x = xs[w.cols]
                    lib.pagecli_quant_linear(
                        w.format.ggml_type, w.data.data_ptr(), w.rows, w.cols, x.data_ptr(),
                        w.cols, 1, y.data_ptr(), w.rows, args.threads,
                    )  # fmt: skip
                if repeat:  # the first pass warms up
                    times[name].append(time.perf_counter() - start)
        first = outs[names[0]]
        same = all(
            all(torch.equal(a, b) for a, b in zip(first, outs[n], strict=True)) for n in names
        )
        rates = "  ".join(
            f"{name}: {total / statistics.median(t) / 1e9:.1f} GB/s" for name, t in times.items()
        )
        print(f"{fmt:<9} {total / 1e6:5.0f} MB  {rates}  results equal: {same}")


if __name__ == "__main__":
    main()
