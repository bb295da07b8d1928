"""The kernel choices under which a verify row gets the bits of a decode alone.

Speculative decoding promises the tokens of decoding without it. A step that checks k drafts
runs k + 1 rows of a sequence where decoding alone runs one, so every kernel must give a row
the same bits in either batch:
- the quantized linear layers: a step with drafts runs its batch through the fused decode
  kernels whatever its size (`fused_rows`), which sum each output in the order they use at
  one row; the panels and tiles that larger batches take sum in their own order (bfloat16
  products too: layers/linear.BF16Linear takes the row kernels up to `fused_rows` rows).
  Steps without drafts keep the process's choice, so prefills have the bits they have
  without speculation;
- the integer paths of Q4_K and Q6_K give each of several rows its batch-1 bits
  (csrc/quant_k.c), but under "auto" AVX-512 VNNI takes them at batch 1 only (its 2-8 rows
  are faster on the float kernels): a step with drafts asks for them at every batch
  (`int_dots` on), so a verify row has the bits of a decode alone (AVX2 takes them at every
  batch, and its Q4_0 and Q4_1 integer path runs only under "on", at every batch);
- attention needs nothing here: it cuts contexts by sequences, not rows
  (pagecli_kernels/native.py: choose_split_tokens).

An engine that runs one sequence at a time (`max_num_seqs` 1: `chat`, bench's latency and
spec scenarios) has no neighbours to share a step with, so it takes the integer paths at
every batch (`int_dots` on) where the CPU has them: on AVX2 that adds Q4_0 and Q4_1, whose
integer batch-1 kernels are 1.2-1.6x as fast as their float ones (their several-row kernels
are slower, which is why engines of several sequences keep them off), and Q4_K's kernel that
scales each sub-block's sum rather than each weight (faster at one row, slower at several:
csrc/quant_k.c); on AVX-512 VNNI the K-quants' verify rows, as above. Every step has the
same choice, so a row's bits do not depend on the step. With speculative decoding too: its
verify rows would be faster on the float kernels of Q4_0 and Q4_1 and on Q4_K's kernel for
batches (benchmarks/RESULTS.md), but its tokens must be bit for bit those of the same engine
without drafts, which takes the integer paths (Q4_K's kernel for one row).

Settings the user chose (`--kernels`) are kept. Each step that needs a change runs under it
and puts the process's settings back after it (about 50 microseconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

from pagecli_kernels import quant_cpu
from pagecli_kernels.settings import FUSED_ROWS_MAX, KernelSettings, applied, apply


def verify_kernel_settings(
    kernels: KernelSettings, rows: int, drafts: bool, one_stream: bool = False
) -> KernelSettings:
    """`kernels` with the choices above filled in where they were left to the CPU, for a step
    of `rows` rows, with drafts to check or not, in an engine of one sequence at a time or
    not."""
    changes: dict[str, object] = {}
    if drafts and kernels.fused_rows == 0 and rows > quant_cpu.fused_rows():
        changes["fused_rows"] = min(rows, FUSED_ROWS_MAX)
    if (
        (one_stream or (drafts and quant_cpu.isa() == "avx512"))
        and kernels.int_dots == "auto"
        and quant_cpu.int_dots()
    ):
        changes["int_dots"] = "on"
    return dataclasses.replace(kernels, **changes) if changes else kernels


@contextmanager
def verify_kernels(rows: int, drafts: bool, one_stream: bool = False) -> Iterator[KernelSettings]:
    """A `with` block for one step under the process's settings with the choices above; the
    previous settings back at its end."""
    previous = applied()
    settings = verify_kernel_settings(previous, rows, drafts, one_stream)
    if settings is previous:
        yield settings
        return
    apply(settings)
    try:
        yield settings
    finally:
        apply(previous)
