"""The native MoE (csrc/layer_program_cpu.c: pagecli_moe, OP_MOE of the layer program) as a
grouped kernel: each chosen expert's rows read once for all the tokens that chose it. Its
output must be, bit for bit, what a per-token loop gets from the same kernel (each token
alone, its k experts one after another), for every router, activation and block format
the families use; and close to the torch loop of layers/moe.py, whose router and softmax
round differently."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagecli.layers.moe import MoESpec, SparseMoE
from pagecli.layers.quant_linear import QuantLinear
from pagecli_kernels import fused_cpu, native
from pagecli_kernels.settings import FUSED_ROWS_MAX, applied, apply
from tests.tiny_models import moe_specs

HIDDEN = 64

SPECS = moe_specs(64)


@pytest.fixture(autouse=True)
def built():
    if native.library() is None:
        pytest.fail(f"the native CPU kernel did not build: {native.unavailable_reason()}")


def quantized_layer(linear: torch.nn.Linear, fmt: str, sizes: list[int]) -> QuantLinear:
    """`linear` as a QuantLinear of `fmt` blocks (float32 rows: F32), its bias kept."""
    from pagecli.loader.quantize import quantize_weight
    from pagecli_kernels.quant_formats import float_rows

    layer = QuantLinear(linear.in_features, sizes, bias=linear.bias is not None)
    start = 0
    for i, size in enumerate(sizes):
        rows = linear.weight.data[start : start + size]
        start += size
        if fmt == "float32":
            layer.set_part(i, float_rows(rows.contiguous()))
        else:
            layer.set_part(i, quantize_weight("w", rows.contiguous(), fmt))
    if linear.bias is not None:
        layer.bias.data.copy_(linear.bias.data)
    return layer


def _moe(spec: MoESpec, fmt: str, seed: int) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(spec, HIDDEN)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("bias") else 0.15)
    experts = list(moe.experts) + ([moe.shared_expert] if moe.shared_expert else [])
    for e in experts:
        e.gate_up_proj = quantized_layer(e.gate_up_proj, fmt, [e.intermediate_size] * 2)
        e.down_proj = quantized_layer(e.down_proj, fmt, [HIDDEN])
    moe.gate = quantized_layer(moe.gate, "float32", [spec.num_experts])  # llama.cpp keeps it F32
    if moe.shared_expert_gate is not None:
        moe.shared_expert_gate = quantized_layer(moe.shared_expert_gate, "float32", [1])
    return moe


@pytest.fixture
def fused_rows():
    """The decode kernels for batches of up to FUSED_ROWS_MAX rows (the choice speculative
    decoding's verify steps make: engine/spec_decode/invariance.py), which sum each output
    in the order they use at one row; the previous settings back afterwards."""
    previous = applied()
    apply(dataclasses.replace(previous, fused_rows=FUSED_ROWS_MAX))
    yield FUSED_ROWS_MAX
    apply(previous)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "float32"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_grouped_experts_equal_a_per_token_loop_bit_for_bit(kind, fmt, fused_rows):
    moe = _moe(SPECS[kind], fmt, seed=3)
    table = moe.native_table()
    assert table is not None
    x = torch.randn(min(40, fused_rows), HIDDEN, generator=torch.Generator().manual_seed(4))
    grouped = fused_cpu.moe(x, table[0])
    alone = torch.cat([fused_cpu.moe(x[t : t + 1], table[0]) for t in range(x.shape[0])])
    # the tokens spread over the experts: every expert is chosen, most by several tokens
    _, chosen = moe.route(x)
    counts = torch.bincount(chosen.flatten(), minlength=moe.spec.num_experts)
    assert (counts > 0).all() and (counts > 1).sum() > moe.spec.num_experts // 2
    assert torch.equal(grouped, alone)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "float32"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_one_region_decode_equals_the_per_expert_loop_bit_for_bit(kind, fmt, tokens):
    """Decode-sized steps on several threads run every chosen expert in one parallel region,
    the threads taking pieces of each projection's columns (csrc/layer_program_cpu.c:
    moe_decode); one thread runs the per-expert loop. Experts 96 wide: the pieces of 64 rows
    cut the gate_up rows across the gate and up parts, and at 3 threads one thread has no
    hidden columns of the sums."""
    spec = moe_specs(96)[kind]
    if spec.shared_intermediate_size:  # whole blocks of 32 (144 is not)
        spec = dataclasses.replace(spec, shared_intermediate_size=192)
    moe = _moe(spec, fmt, seed=7)
    table = moe.native_table()
    assert table is not None
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(8))
    previous = torch.get_num_threads()
    try:
        outputs = {}
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs[threads] = fused_cpu.moe(x, table[0])
    finally:
        torch.set_num_threads(previous)
    assert outputs[1].abs().sum() > 0
    assert torch.equal(outputs[2], outputs[1])
    assert torch.equal(outputs[3], outputs[1])


@pytest.mark.parametrize("kind", list(SPECS))
def test_native_moe_follows_the_torch_loop(kind):
    moe = _moe(SPECS[kind], "q8_0", seed=5)
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(6))
    native_out = moe(x)  # the native table's kernel
    moe._table = (None,)  # no table: the torch loop over the same QuantLinear experts
    loop_out = moe(x)
    torch.testing.assert_close(native_out, loop_out, atol=1e-5, rtol=1e-4)
