"""The Triton fused MoE (pagecli_kernels/fused_moe.py) against float64 and against the torch
loop of layers/moe.py.

Run by Triton's interpreter on CPU tensors (tests/kernels/conftest.py), or compiled on CUDA
with PAGECLI_KERNEL_TEST_DEVICE=cuda. The pairs of a step sorted by expert with runs padded to
the block (some experts chosen by none, one by more pairs than a block holds), rows gathered
per pair, the bias and the routing weight in the same launch; then the whole MoE for the
routers and activations the families use.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

DEVICE = os.environ.get("PAGECLI_KERNEL_TEST_DEVICE", "cpu")


def test_align_sorts_the_pairs_by_expert_in_padded_runs():
    from pagecli_kernels.fused_moe import align

    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 chosen by none
    pairs, owners = align(experts, 4, block_m=4)
    assert owners.tolist() == [0, 2, 3]
    assert pairs.tolist() == [1, 4, 6, 6, 0, 2, 5, 6, 3, 6, 6, 6]  # pad: 6 pairs


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_pair", [1, 3])
def test_grouped_linear_matches_float64(bias, rows_per_pair):
    from pagecli_kernels.fused_moe import BLOCK_M, align, grouped_linear

    gen = torch.Generator().manual_seed(rows_per_pair + 2 * bias)
    num_experts, n, k = 5, 40, 72  # N and K not multiples of the blocks
    tokens = 2 * BLOCK_M  # with rows_per_pair 3: expert 0 takes more pairs than a block
    chosen = torch.randint(0, num_experts, (tokens, rows_per_pair), generator=gen)
    chosen[:, 0] = 0
    pairs, owners = align(chosen, num_experts)
    num_pairs = chosen.numel()
    a = torch.randn(tokens if rows_per_pair > 1 else num_pairs, k, generator=gen)
    weights = torch.randn(num_experts, n, k, generator=gen)
    b = torch.randn(num_experts, n, generator=gen) if bias else None
    route = torch.rand(num_pairs, generator=gen)
    got = grouped_linear(
        a.to(DEVICE), weights.to(DEVICE), None if b is None else b.to(DEVICE),
        pairs.to(DEVICE), owners.to(DEVICE), num_pairs, rows_per_pair, route.to(DEVICE),
    ).cpu()  # fmt: skip
    flat = chosen.reshape(-1)
    for p in range(num_pairs):
        row = a[p // rows_per_pair].double() @ weights[flat[p]].double().T
        if b is not None:
            row = row + b[flat[p]].double()
        row = row * route[p].double()
        torch.testing.assert_close(got[p].double(), row, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["softmax_topk", "shared", "gpt_oss"])
def test_fused_moe_follows_the_torch_loop(kind):
    from pagecli.layers.moe import SparseMoE
    from tests.tiny_models import moe_specs

    spec = moe_specs(48)[kind]  # 48: the kernel's masks at widths past whole blocks
    torch.manual_seed(7)
    moe = SparseMoE(spec, 64)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("bias") else 0.2)
    moe = moe.to(DEVICE)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    moe.impl = "torch"  # neither Triton nor the native table: the loop
    with torch.no_grad():
        loop = moe(x)
        moe.impl = "triton"
        fused = moe(x)
    assert moe.stacked() is not None
    gate_up = moe.stacked()[0]
    # every expert's projection is now a view of the stack: held once
    assert moe.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()
    torch.testing.assert_close(fused.cpu(), loop.cpu(), rtol=1e-4, atol=1e-5)
