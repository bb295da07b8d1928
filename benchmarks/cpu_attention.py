"""Time the CPU paged attention paths (a script, not a test).

For each KV dtype (float32, bfloat16, float16) and each case, the native C kernel on every
instruction-set path this CPU runs (portable, AVX2, AVX-512), the torch gather + SDPA path
(native kernel off), and for the single long sequence the kernel with split-K off, so the
split's gain is measured. Cases: decode 64 x 300 cached tokens (the engine's 64-sequence step),
decode 1 x 4096, prefill 4 x 256 new tokens over a 256-token prefix. num_heads 9,
num_kv_heads 3, head_dim 64 (the default model), block_size 16; median of several repetitions
at the engine's thread count (2).

    .venv/bin/python benchmarks/cpu_attention.py [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch
from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs

from pagecli_kernels import cpu, native
from pagecli_kernels.settings import kernel_settings

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def _batch(seq_lens: list[int], query_lens: list[int]):
    """Random caches with shuffled block tables, and the query tokens."""
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks):
        block_tables[i, :n] = perm[start : start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    query_start_loc = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    return query, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale = HEAD_DIM**-0.5
    cases = [
        ("decode 64 x 300", [300] * 64, [1] * 64),
        ("decode 1 x 4096", [4096], [1]),
        ("prefill 4 x 256 over 256", [512] * 4, [256] * 4),
    ]
    state = f"on, paths {native.supported_isas()}" if native.library() else "unavailable"
    print(f"native kernel: {state}; {torch.get_num_threads()} threads")
    print(f"{'case':<26}{'dtype':<10}{'path':<18}{'ms':>9}{'KV GB/s':>9}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, seq_lens, query_lens in cases:
            q, k, v, bt, lens, qsl = _batch(seq_lens, query_lens)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            kv_bytes = 2 * sum(seq_lens) * NUM_KV_HEADS * HEAD_DIM * k.element_size()

            def run(q=q, k=k, v=v, bt=bt, lens=lens, qsl=qsl):
                return cpu.paged_prefill_attention(q, k, v, bt, lens, qsl, scale)

            timings = []
            for isa in native.supported_isas():
                with kernel_settings(isa=isa):
                    timings.append((f"native {isa}", median_ms(run, args.repeats)))
            if len(seq_lens) == 1:
                max_len = max(seq_lens)

                def unsplit(q=q, k=k, v=v, bt=bt, lens=lens, qsl=qsl, m=max_len):
                    return native.paged_attention(
                        q, k, v, bt, lens, qsl, scale, max_seq_len=m, split_tokens=0
                    )

                timings.append((f"{native.isa()} no split", median_ms(unsplit, args.repeats)))
            with kernel_settings(native=False):
                timings.append(("torch", median_ms(run, args.repeats)))
            for path, ms in timings:
                gbps = kv_bytes / (ms / 1e3) / 1e9
                print(
                    f"{name:<26}{str(dtype).removeprefix('torch.'):<10}{path:<18}{ms:>9.2f}"
                    f"{gbps:>9.1f}"
                )


if __name__ == "__main__":
    main()
