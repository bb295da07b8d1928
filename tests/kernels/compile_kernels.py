"""Compile every shipped Triton kernel variant for Hopper (sm_90) without a GPU.

Run as a script with TRITON_INTERPRET unset (the interpreter replaces @triton.jit functions,
so nothing could be compiled): `python tests/kernels/compile_kernels.py [--full]`. Exits 1 when
a variant fails to compile or ptxas reports register spills. By default it compiles a
representative subset (every head_dim and dtype at block_size 16); `--full`, or
PAGECLI_COMPILE_ALL=1, adds every supported block size and more GQA groups and split counts.
The attention kernels compile without and with attention sinks (HAS_SINKS; by default the
latter for the largest head_dim only, the one nearest to spilling; every variant with --full).
The sliding window is a runtime argument, so every variant takes one.
`--kernel NAME` (repeatable) compiles only the variants of those kernel functions.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas

from pagecli_kernels._triton_utils import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_DIMS

# `from pagecli_kernels import store_kv` is the public op; import_module gives the module.
decode_attention = importlib.import_module("pagecli_kernels.decode_attention")
prefill_attention = importlib.import_module("pagecli_kernels.prefill_attention")
token_bitmask = importlib.import_module("pagecli_kernels.token_bitmask")
gated_delta = importlib.import_module("pagecli_kernels.gated_delta")
fused_moe = importlib.import_module("pagecli_kernels.fused_moe")

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
INT_POINTERS = {
    "block_tables_ptr",
    "seq_lens_ptr",
    "query_start_loc_ptr",
    "bitmask_ptr",
    "starts_ptr",
}
INT64_POINTERS = {"slot_mapping_ptr", "rows_ptr", "slots_ptr", "pairs_ptr", "experts_ptr"}
FP32_POINTERS = {"partial_max_ptr", "partial_sum_ptr", "partial_out_ptr", "sinks_ptr"}
FLOAT_SCALARS = {"scale"}


@dataclass
class Variant:
    """One kernel specialization: its constexprs, element type and launch options."""

    module: str
    kernel: str
    dtype: str
    constexprs: dict
    options: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel}[{self.dtype}]({consts})"


def _signature(fn, variant: Variant) -> tuple[dict, dict]:
    """Argument types as the JIT would see them: 16-byte aligned pointers and strides."""
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in variant.constexprs:
            signature[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            if name in INT64_POINTERS:
                signature[name] = "*i64"
            elif name in INT_POINTERS:
                signature[name] = "*i32"
            elif name in FP32_POINTERS:
                signature[name] = "*fp32"
            else:
                signature[name] = f"*{variant.dtype}"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_") or name == "tokens_per_split":
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def variants(full: bool) -> list[Variant]:
    """The kernel variants the launchers can produce, a representative subset unless full."""
    block_sizes = SUPPORTED_BLOCK_SIZES if full else (16,)
    # Decode handles at most 16 heads per program whatever the group.
    groups = (1, 32) if full else (4,)
    splits = (1, 2, 32) if full else (1, 8)
    out = []
    for dtype, type_name in DTYPES.items():
        for head_dim in SUPPORTED_HEAD_DIMS:
            block_d = triton.next_power_of_2(head_dim)
            decode_config = decode_attention.launch_config(head_dim, dtype)
            decode_options = {k: decode_config[k] for k in ("num_warps", "num_stages")}
            prefill_config = prefill_attention.launch_config(head_dim, dtype)
            prefill_options = {k: prefill_config[k] for k in ("num_warps", "num_stages")}
            with_sinks = full or head_dim == max(SUPPORTED_HEAD_DIMS)
            sink_variants = (False, True) if with_sinks else (False,)
            for block_size in block_sizes:
                out.append(
                    Variant(
                        "store_kv",
                        "_store_kv_kernel",
                        type_name,
                        dict(
                            NUM_KV_HEADS=8,
                            HEAD_DIM=head_dim,
                            BLOCK_HEADS=8,
                            BLOCK_D=block_d,
                            BLOCK_SIZE=block_size,
                        ),
                        {"num_warps": 4},
                    )
                )
                for group in groups:
                    for has_sinks in sink_variants:
                        for num_splits in splits:
                            out.append(
                                Variant(
                                    "decode_attention",
                                    "_decode_attention_kernel",
                                    type_name,
                                    dict(
                                        GROUP=group,
                                        BLOCK_H=decode_attention.BLOCK_H,
                                        HEAD_DIM=head_dim,
                                        BLOCK_D=block_d,
                                        BLOCK_SIZE=block_size,
                                        BLOCK_N=decode_config["BLOCK_N"],
                                        NUM_SPLITS=num_splits,
                                        HAS_SINKS=has_sinks,
                                        UPCAST=dtype == torch.float32,
                                    ),
                                    decode_options,
                                )
                            )
                        out.append(
                            Variant(
                                "prefill_attention",
                                "_prefill_attention_kernel",
                                type_name,
                                dict(
                                    GROUP=group,
                                    HEAD_DIM=head_dim,
                                    BLOCK_D=block_d,
                                    BLOCK_SIZE=block_size,
                                    BLOCK_M=prefill_config["BLOCK_M"],
                                    BLOCK_N=prefill_config["BLOCK_N"],
                                    HAS_SINKS=has_sinks,
                                    UPCAST=dtype == torch.float32,
                                ),
                                prefill_options,
                            )
                        )
            for has_sinks in sink_variants:
                for num_splits in (2, 4, 8, 16, 32) if full else splits[1:]:
                    out.append(
                        Variant(
                            "decode_attention",
                            "_decode_reduce_kernel",
                            type_name,
                            dict(
                                HEAD_DIM=head_dim,
                                BLOCK_D=block_d,
                                NUM_SPLITS=num_splits,
                                HAS_SINKS=has_sinks,
                            ),
                            {"num_warps": 4},
                        )
                    )
        if dtype == torch.float32:  # the DeltaNet recurrence: float32 states and inputs
            for k_dim in gated_delta.SUPPORTED_K_DIMS if full else (128,):
                for tiled in (False, True):
                    out.append(
                        Variant(
                            "gated_delta",
                            "_gated_delta_kernel",
                            type_name,
                            dict(
                                K_DIM=k_dim,
                                V_DIM=128,
                                BLOCK_V=gated_delta.block_v(128),
                                TILED=tiled,
                            ),
                            {"num_warps": 4},
                        )
                    )
        for rows_per_pair, has_bias, mul_route in ((4, True, False), (1, True, True)):
            out.append(  # the MoE's two grouped launches (gpt-oss's: biases, top 4)
                Variant(
                    "fused_moe",
                    "_grouped_kernel",
                    type_name,
                    dict(
                        ROWS_PER_PAIR=rows_per_pair,
                        HAS_BIAS=has_bias,
                        MUL_ROUTE=mul_route,
                        IEEE=dtype == torch.float32,
                        BLOCK_M=fused_moe.BLOCK_M,
                        BLOCK_N=fused_moe.BLOCK_N,
                        BLOCK_K=fused_moe.BLOCK_K,
                    ),
                    {"num_warps": 4},
                )
            )
        out.append(
            Variant(
                "token_bitmask",
                "_apply_token_bitmask_kernel",
                type_name,
                dict(BLOCK_WORDS=token_bitmask.BLOCK_WORDS),
                {"num_warps": 4},
            )
        )
    return out


def _ptxas_usage(ptx: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) that ptxas reports for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(90).path, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src]
        cmd += ["-o", os.path.join(tmp, "kernel.o")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def compile_variant(variant: Variant) -> tuple[str, str | None, int, int]:
    """Compile one variant; return (name, error or None, registers, spilled bytes)."""
    fn = getattr(importlib.import_module(f"pagecli_kernels.{variant.module}"), variant.kernel)
    signature, attrs = _signature(fn, variant)
    try:
        source = triton.compiler.ASTSource(
            fn=fn, signature=signature, constexprs=variant.constexprs, attrs=attrs
        )
        compiled = triton.compile(source, target=TARGET, options=variant.options)
        regs, spill_stores, spill_loads = _ptxas_usage(compiled.asm["ptx"])
    except Exception as exc:  # report every failing variant, not just the first
        return variant.name, f"{type(exc).__name__}: {str(exc)[:2000]}", 0, 0
    return variant.name, None, regs, spill_stores + spill_loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true", help="every shipped variant")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kernel", action="append", help="only this kernel function's variants")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile kernels", file=sys.stderr)
        return 2
    full = args.full or os.environ.get("PAGECLI_COMPILE_ALL") == "1"
    todo = [v for v in variants(full) if not args.kernel or v.kernel in args.kernel]
    if not todo:
        print(f"no variants of {args.kernel}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    failures = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, error, regs, spilled in pool.map(compile_variant, todo):
            if error is not None:
                failures += 1
                print(f"FAIL {name}: {error}")
            elif spilled:
                failures += 1
                print(f"SPILL {name}: {regs} registers, {spilled} bytes spilled")
            else:
                print(f"ok   {name}: {regs} registers")
    elapsed = time.perf_counter() - start
    print(f"{len(todo)} variants for sm_90, {failures} failed, {elapsed:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
