"""Packed CPU linear layers: same products as F.linear to float32 rounding, any batch size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagecli.engine.model_runner import keep_freed_memory
from pagecli.layers.linear import PackedLinear, pack_linears, packing_supported

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32, torch.device("cpu")),
    reason="this torch build has no oneDNN linear packing",
)


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    packed = PackedLinear(weight, b)
    torch.testing.assert_close(packed(x), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    # leading dims and a non-contiguous input
    x3 = torch.randn(2, rows, 80, generator=gen)[..., ::2]
    torch.testing.assert_close(packed(x3), F.linear(x3, weight, b), atol=1e-5, rtol=1e-5)


def test_pack_linears_replaces_every_linear_and_keeps_the_function():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    x = torch.randn(5, 16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_packing_is_for_float32_on_the_cpu_only():
    assert not packing_supported(torch.bfloat16, torch.device("cpu"))
    assert not packing_supported(torch.float32, torch.device("cuda"))


def test_allocator_keeps_freed_memory_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True
