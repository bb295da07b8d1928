"""Time the fast CPU paged attention against the reference (a script, not a test).

The fast path is timed as the engine runs it (decode through the native C kernel when it
builds) and with the native kernel off (the torch gather + SDPA path).
Decode: 32 sequences x 512 cached tokens. Prefill: 4 sequences x 256 new tokens over a
256-token cached prefix. num_heads 9, num_kv_heads 3, head_dim 64, float32, block_size 16;
median of several repetitions with 1 and 2 torch threads.

    .venv/bin/python benchmarks/cpu_attention.py [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
from _timing import median_ms  # benchmarks/ is on sys.path when a script here runs

from pagecli_kernels import cpu, native, reference

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
    parser.add_argument("--reference-repeats", type=int, default=1, help="the reference is slow")
    args = parser.parse_args()
    scale = HEAD_DIM**-0.5

    q, k, v, bt, lens, _ = _batch([512] * 32, [1] * 32)
    decode = (q, k, v, bt, lens, scale)
    q, k, v, bt, lens, qsl = _batch([512] * 4, [256] * 4)
    prefill = (q, k, v, bt, lens, qsl, scale)

    cases = [
        ("decode 32 x 512", cpu.paged_decode_attention, reference.paged_decode_attention, decode),
        (
            "prefill 4 x 256 over 256",
            cpu.paged_prefill_attention,
            reference.paged_prefill_attention,
            prefill,
        ),
    ]
    native_state = "on" if native.library() else f"unavailable ({native.unavailable_reason()})"
    print(f"native decode kernel: {native_state}")
    print(
        f"{'case':<26}{'threads':>8}{'cpu ms':>10}{'torch-only ms':>15}{'reference ms':>14}"
        f"{'speed-up':>10}"
    )
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, fast, ref, case_args in cases:
            fast_ms = median_ms(lambda f=fast, a=case_args: f(*a), args.repeats)
            native.set_enabled(False)
            torch_ms = median_ms(lambda f=fast, a=case_args: f(*a), args.repeats)
            native.set_enabled(True)
            ref_ms = median_ms(lambda f=ref, a=case_args: f(*a), args.reference_repeats)
            print(
                f"{name:<26}{threads:>8}{fast_ms:>10.2f}{torch_ms:>15.2f}{ref_ms:>14.1f}"
                f"{ref_ms / fast_ms:>9.0f}x"
            )


if __name__ == "__main__":
    main()
