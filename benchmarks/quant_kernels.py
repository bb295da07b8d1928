"""Stream the default model's projections through the quantized CPU kernels (a script).

The 30 layers' q/k/v, o, gate/up and down weights (and the 49152 x 576 output projection) are
made as random blocks of one format with the default model's shapes, then multiplied in turn,
as one decode step does, so they stream from memory as in the engine (66 MB in Q4_1, far
past the L2 caches). For each format, instruction-set path and number of input rows it prints
the time per pass and the GB/s of weights read, next to the machine's read bandwidth (a
float32 sum over 1 GiB). Median of --repeats passes after a warm-up.

    .venv/bin/python benchmarks/quant_kernels.py [--threads 2] [--repeats 7]
        [--formats q4_1,q8_0,q4_0] [--rows 1,4,8] [--prefetch l1,l2] [--tiles off,on]
        [--int-dots off,on] [--gemm blas,native] [--vnni-q4-k on]
        [--shape default|1b|8b]

--prefetch names the cache levels the batch-1 kernels' software prefetch may fill (the
default: the CPU's default only); --tiles whether batches of more than 8 rows multiply on
AMX's tiles (csrc/gemm_quant_amx.c) or on the float32 panels (default: auto only); --gemm who
multiplies the float32 panels: torch's sgemm (blas) or csrc/gemm_f32.c (native). With
several choices, their passes alternate, so all see the same neighbours. GFLOP/s counts
2 x rows x weights per pass.

Each product goes through quant_cpu.PreparedLinear, the engine's own call (its Python cost is
a few microseconds of the pass); the choices are made through pagecli_kernels.settings (the
checkouts that have it), so two commits can be compared on one machine, one after the other.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from pagecli_kernels import quant_cpu
from pagecli_kernels.quant_formats import FORMATS, QuantWeight
from pagecli_kernels.settings import KernelSettings, apply

# name: (hidden, intermediate, q + k + v rows, vocabulary, layers); 1b and 8b are Llama-3.2-1B
# and Llama-3-8B with the default model's vocabulary (the K-quants need 256-value rows).
MODEL_SHAPES = {
    "default": (576, 1536, 960, 49152, 30),
    "1b": (2048, 8192, 3072, 49152, 16),
    "8b": (4096, 14336, 6144, 49152, 32),
}
FUSED_ROWS = 8  # csrc/quant_linear_cpu.c's FUSED_MAX_ROWS: up to it, never panels or AMX
SCALE_OFFSETS = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2]}


def random_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> QuantWeight:
    f = FORMATS[fmt]
    blocks = cols // f.block_values
    data = rng.integers(0, 256, size=(rows, blocks, f.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(fmt, [f.block_bytes - 2]):
        scales = (rng.standard_normal((rows, blocks)) * 0.02).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return QuantWeight(f, torch.from_numpy(data.reshape(rows, -1)), cols)


def model_weights(fmt: str, shape: str, rng: np.random.Generator) -> list[QuantWeight]:
    """Random `fmt` blocks for one decode step's projections of the `shape` model: each
    layer's q/k/v, o, gate/up and down, then the output projection."""
    hidden, intermediate, q_kv, vocab, layers = MODEL_SHAPES[shape]
    shapes = [(q_kv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    weights = [random_weight(fmt, n, k, rng) for _ in range(layers) for n, k in shapes]
    weights.append(random_weight(fmt, vocab, hidden, rng))
    return weights


def read_bandwidth() -> float:
    data = torch.ones(1 << 28)  # 1 GiB of float32
    data.sum()
    best = min(_time(data.sum) for _ in range(5))
    return data.numel() * 4 / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", default="q4_1,q8_0,q4_0")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--prefetch", default=None, help="l1, l2 or l1,l2 (default: the CPU's)")
    parser.add_argument("--tiles", default=None, help="off, on, auto or a list (default: auto)")
    parser.add_argument(
        "--int-dots", default=None, help="off, on, auto or a list (default: auto): batch-1 VNNI"
    )
    parser.add_argument(
        "--gemm", default=None, help="blas, native, auto or a list (default: auto): the panels"
    )
    parser.add_argument("--shape", default="default", choices=sorted(MODEL_SHAPES))
    parser.add_argument(
        "--vnni-q4-k", default="auto", help="auto, off or on: Q4_K on VNNI's integer kernels"
    )
    args = parser.parse_args()
    hidden, intermediate = MODEL_SHAPES[args.shape][:2]
    torch.set_num_threads(args.threads)
    levels = args.prefetch.split(",") if args.prefetch else [None]
    tiles = args.tiles.split(",") if args.tiles else [None]
    ints = args.int_dots.split(",") if args.int_dots else [None]
    gemms = args.gemm.split(",") if args.gemm else [None]
    variants = [(lv, t, i, g) for lv in levels for t in tiles for i in ints for g in gemms]
    bandwidth = read_bandwidth() / 1e9
    print(f"{args.shape} shapes, {args.threads} threads, read bandwidth {bandwidth:.1f} GB/s")
    print(
        f"{'format':<7}{'isa':<9}{'rows':>5}{'prefetch':>9}{'tiles':>6}{'int':>5}{'gemm':>7}"
        f"{'ms/pass':>9}"
        f"{'MB':>7}"
        f"{'GB/s':>7}{'GFLOP/s':>9}"
    )
    rng = np.random.default_rng(0)
    for fmt in args.formats.split(","):
        weights = model_weights(fmt, args.shape, rng)
        total = sum(w.nbytes for w in weights)
        values = sum(w.rows * w.cols for w in weights)
        for isa in quant_cpu.supported_isas():
            if isa == "portable":
                continue  # for correctness, not speed
            for rows in map(int, args.rows.split(",")):
                xs = {k: torch.randn(rows, k) for k in (hidden, intermediate)}

                calls = [(quant_cpu.PreparedLinear(w), xs[w.cols]) for w in weights]

                def one_pass(calls=calls) -> None:
                    for prepared, x in calls:
                        prepared(x)

                times: dict = {variant: [] for variant in variants}
                for repeat in range(args.repeats + 1):
                    for variant in variants:
                        choose(isa, *variant, args.vnni_q4_k)
                        took = _time(one_pass)
                        if repeat:  # the first round warms up
                            times[variant].append(took)
                for variant in variants:
                    choose(isa, *variant, args.vnni_q4_k)
                    shown = quant_cpu.prefetch()
                    tiled = "on" if quant_cpu.tiles() else "off"
                    if rows <= FUSED_ROWS or fmt not in quant_cpu.TILES_FORMATS:
                        tiled = "-"  # the fused path, or a format without AMX's tiles
                    integer = "on" if quant_cpu.int_dots() else "off"
                    if rows > FUSED_ROWS or fmt not in quant_cpu.int_dots_formats():
                        integer = "-"  # the panels, or a format without an integer path
                    gemm = quant_cpu.gemm() or "off"
                    if rows <= FUSED_ROWS or tiled == "on":
                        gemm = "-"  # the fused path, or the tiles
                    ms = statistics.median(times[variant]) * 1e3
                    print(
                        f"{fmt:<7}{isa:<9}{rows:>5}{shown:>9}{tiled:>6}{integer:>5}{gemm:>7}"
                        f"{ms:>9.2f}"
                        f"{total / 1e6:>7.1f}{total / (ms / 1e3) / 1e9:>7.1f}"
                        f"{2 * rows * values / (ms / 1e3) / 1e9:>9.0f}"
                    )
        apply(KernelSettings())


def choose(
    isa: str,
    level: str | None,
    tiles: str | None,
    int_dots: str | None,
    gemm: str | None,
    vnni_q4_k: str = "auto",
) -> None:
    """The path, the prefetch level, and the tiles, int-dots, GEMM and vnni_q4_k choices (None:
    auto)."""
    apply(
        KernelSettings(
            isa=isa,
            prefetch=level or "auto",
            tiles=tiles or "auto",
            int_dots=int_dots or "auto",
            gemm=gemm or "auto",
            vnni_q4_k=vnni_q4_k,
        )
    )


if __name__ == "__main__":
    main()
