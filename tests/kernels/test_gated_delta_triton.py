"""The Triton Gated DeltaNet recurrence (pagecli_kernels/gated_delta.py) against float64.

Run by Triton's interpreter on CPU tensors (tests/kernels/conftest.py), or compiled on CUDA
with PAGECLI_KERNEL_TEST_DEVICE=cuda. One launch holds decodes and prefill chunks of
sequences in scattered state slots, value heads grouped by key head and tiled, state columns
in one block and in several; a second launch continues from the states the first left.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

DEVICE = os.environ.get("PAGECLI_KERNEL_TEST_DEVICE", "cpu")
SLOTS = 5


def reference(q, k, v, g, beta, states, slots, starts, tiled):
    """Token by token in float64; updates `states` (float64) in place."""
    num_k, num_v = k.shape[1], v.shape[1]
    heads = [h % num_k if tiled else h // (num_v // num_k) for h in range(num_v)]
    out = torch.empty(v.shape, dtype=torch.float64)
    for i, slot in enumerate(slots.tolist()):
        state = states[slot]  # [Hv, dk, dv]
        for t in range(int(starts[i]), int(starts[i + 1])):
            qt, kt = q[t, heads].double(), k[t, heads].double()  # [Hv, dk]
            state.mul_(g[t].double().exp()[:, None, None])
            delta = (v[t].double() - torch.einsum("hkv,hk->hv", state, kt)) * beta[t, :, None]
            state.add_(kt[:, :, None] * delta[:, None, :])
            out[t] = torch.einsum("hkv,hk->hv", state, qt)
    return out


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("v_dim", [16, 64])  # one block of state columns, two
def test_recurrence_matches_float64(tiled, v_dim):
    from pagecli_kernels.gated_delta import gated_delta_recurrence

    gen = torch.Generator().manual_seed(v_dim + tiled)
    num_k, num_v, k_dim = 2, 4, 16
    states = 0.1 * torch.randn(SLOTS, num_v, k_dim, v_dim, generator=gen)
    expected_states = states.double()
    states = states.to(DEVICE)
    for lengths, slot_list in (([1, 37, 6], [3, 0, 4]), ([1, 1, 9], [0, 4, 1])):
        total = sum(lengths)
        q = torch.nn.functional.normalize(torch.randn(total, num_k, k_dim, generator=gen), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(total, num_k, k_dim, generator=gen), dim=-1)
        q = q * k_dim**-0.5
        v = torch.randn(total, num_v, v_dim, generator=gen)
        g = -torch.rand(total, num_v, generator=gen)
        beta = torch.rand(total, num_v, generator=gen)
        slots = torch.tensor(slot_list, dtype=torch.int64)
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        got = gated_delta_recurrence(
            *(t.to(DEVICE) for t in (q, k, v, g, beta)), states, slots.to(DEVICE),
            starts.to(DEVICE), tiled,
        )  # fmt: skip
        want = reference(q, k, v, g, beta, expected_states, slots, starts, tiled)
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(states.cpu().double(), expected_states, rtol=1e-4, atol=1e-5)
    assert torch.equal(states[2].cpu().double(), expected_states[2])  # a slot nobody used


def test_shapes_it_does_not_take_are_errors():
    from pagecli_kernels.gated_delta import gated_delta_recurrence

    q = torch.zeros(2, 1, 24)  # key heads of 24: not a power of two
    with pytest.raises(ValueError, match="key heads of 24"):
        gated_delta_recurrence(q, q, torch.zeros(2, 1, 16), torch.zeros(2, 1),
                               torch.zeros(2, 1), torch.zeros(1, 1, 24, 16),
                               torch.zeros(1, dtype=torch.int64),
                               torch.tensor([0, 2], dtype=torch.int32))  # fmt: skip
