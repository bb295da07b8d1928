"""The native Gated DeltaNet step (csrc/gated_delta_cpu.c) against a float64 recurrence.

One step of a layer holds decodes (one token each) and prefill chunks (many) of sequences in
scattered state slots; it runs twice, so the second step starts from the states the first
left (a chunk after a chunk, a decode after a prefill). Value heads grouped by key head
(transformers' order) and tiled (llama.cpp's) are both covered; outputs, conv windows and
recurrent states of the native step and of the torch layer (its chunked form) must agree with
a float64 token-by-token computation to float32 rounding. The
layer program's binding refuses DeltaNet ops of the wrong shape, and a slot outside the
stores is an error, not a write past them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagecli.layers.attention import AttentionMetadata
from pagecli.layers.gated_delta import DeltaNetSpec, GatedDeltaNet, StateStore
from pagecli_kernels import fused_cpu, layers_cpu, native
from pagecli_kernels import layer_ops as ops

pytestmark = pytest.mark.skipif(
    not native.enabled(), reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

HIDDEN = 48
SLOTS = 6


def _layer(tiled: bool, seed: int) -> GatedDeltaNet:
    spec = DeltaNetSpec(2, 4, 16, 8, 4, 1e-6, v_heads_tiled=tiled)
    layer = GatedDeltaNet(spec, HIDDEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        layer.A_log.copy_(torch.rand(spec.num_v_heads, generator=gen).log())
        layer.norm.weight.copy_(1 + 0.1 * torch.randn(spec.v_head_dim, generator=gen))
    return layer


def _meta(decodes: list[int], prefills: list[tuple[int, int]]) -> AttentionMetadata:
    """A step of one-token decodes (their slots) then prefill chunks (slot, tokens)."""
    lengths = [1] * len(decodes) + [n for _, n in prefills]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    prefill_starts = starts[len(decodes) :] - len(decodes)
    return AttentionMetadata(
        slot_mapping=torch.zeros(1, int(starts[-1]), dtype=torch.int64),
        num_decode_tokens=len(decodes),
        decode_block_tables=None,
        decode_seq_lens=None,
        prefill_block_tables=None,
        prefill_seq_lens=None,
        prefill_query_start_loc=prefill_starts if prefills else None,
        state_slots=torch.tensor([*decodes, *(s for s, _ in prefills)], dtype=torch.int64),
        state_starts=starts,
    )


def _stores(layer: GatedDeltaNet, dtype: torch.dtype, seed: int) -> StateStore:
    store = StateStore.zeros(layer.spec, SLOTS, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    store.conv.copy_(torch.randn(store.conv.shape, generator=gen))
    store.ssm.copy_(0.1 * torch.randn(store.ssm.shape, generator=gen))
    return store


def _reference(layer: GatedDeltaNet, projected: torch.Tensor, store: StateStore, meta):
    """The layer's step after its input projection in float64, token by token, from the
    module docstring of layers/gated_delta.py; updates the (float64) `store` in place."""
    s = layer.spec
    p = projected.double()
    w = layer.conv1d.weight[:, 0].double()  # [C, K]
    a_coef = -layer.A_log.double().exp()
    dt_bias, norm_w = layer.dt_bias.double(), layer.norm.weight.double()
    out = torch.empty(p.shape[0], s.value_dim, dtype=torch.float64)
    starts = meta.state_starts.tolist()
    r = s.num_v_heads // s.num_k_heads
    for i, slot in enumerate(meta.state_slots.tolist()):
        rows = p[starts[i] : starts[i + 1]]
        seq = torch.cat([store.conv[slot].t(), rows[:, : s.conv_dim]])  # [K - 1 + n, C]
        state = store.ssm[slot]  # [Hv, dk, dv]
        for t in range(rows.shape[0]):
            window = seq[t : t + s.conv_kernel]  # [K, C]
            x = torch.nn.functional.silu((window * w.t()).sum(0))
            q, k, v = x.split([s.key_dim, s.key_dim, s.value_dim])
            q = q.view(s.num_k_heads, -1)
            k = k.view(s.num_k_heads, -1)
            q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * s.k_head_dim**-0.5
            k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
            heads = [h % s.num_k_heads if s.v_heads_tiled else h // r for h in range(s.num_v_heads)]
            q, k, v = q[heads], k[heads], v.view(s.num_v_heads, -1)
            z, b, a = rows[t, s.conv_dim :].split([s.value_dim, s.num_v_heads, s.num_v_heads])
            beta = b.sigmoid()
            decay = (a_coef * torch.nn.functional.softplus(a + dt_bias)).exp()
            state.mul_(decay[:, None, None])
            delta = (v - torch.einsum("hkv,hk->hv", state, k)) * beta[:, None]
            state.add_(k[:, :, None] * delta[:, None, :])
            o = torch.einsum("hkv,hk->hv", state, q)  # [Hv, dv]
            o = o / (o.pow(2).mean(-1, keepdim=True) + s.eps).sqrt() * norm_w
            out[starts[i] + t] = (o * torch.nn.functional.silu(z.view(s.num_v_heads, -1))).flatten()
        store.conv[slot] = seq[-(s.conv_kernel - 1) :].t()
    return out


@pytest.mark.parametrize("tiled", [False, True])
def test_native_step_matches_float64(tiled):
    """The native step, and the torch one (native kernels off), against the float64
    recurrence, over two steps of scattered slots."""
    from pagecli_kernels.settings import kernel_settings

    layer = _layer(tiled, seed=1)
    torch_layer = _layer(tiled, seed=1)
    layer.slots = _stores(layer, torch.float32, seed=2)
    torch_layer.slots = StateStore(layer.slots.conv.clone(), layer.slots.ssm.clone())
    reference = StateStore(layer.slots.conv.double(), layer.slots.ssm.double())
    steps = [
        _meta([4], [(1, 70), (3, 5)]),  # a decode of a warm slot, a long chunk, a short one
        _meta([1, 3], [(0, 9), (4, 1)]),  # decodes after those prefills; more chunks
    ]
    gen = torch.Generator().manual_seed(3)
    s = layer.spec
    for meta in steps:
        hidden = torch.randn(int(meta.state_starts[-1]), HIDDEN, generator=gen)
        with torch.no_grad():
            projected = layer.in_proj(hidden)
            assert layer.native_takes(projected)
            got = fused_cpu.gated_delta(
                projected, layer.native_weights(), layer.norm.eps, layer.slots.conv,
                layer.slots.ssm, meta.state_slots, meta.state_starts,
                (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim), tiled,
            )  # fmt: skip
            want = _reference(layer, projected, reference, meta)
            with kernel_settings(native=False):
                from_torch = torch_layer(hidden, meta)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(from_torch, layer.out_proj(want.float()), rtol=1e-4, atol=1e-5)
        for store in (layer.slots, torch_layer.slots):
            torch.testing.assert_close(store.ssm.double(), reference.ssm, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(store.conv.double(), reference.conv)
    untouched = [2, 5]  # slots no sequence of the steps used
    assert torch.equal(layer.slots.ssm[untouched].double(), reference.ssm[untouched])


def test_a_slot_outside_the_stores_is_an_error():
    layer = _layer(False, seed=4)
    layer.slots = _stores(layer, torch.float32, seed=5)
    with pytest.raises(ValueError, match="slot"):
        layer(torch.randn(1, HIDDEN), _meta([SLOTS], []))
    with pytest.raises(ValueError, match="slot"):
        layer(torch.randn(2, HIDDEN), _meta([], [(-1, 2)]))


def test_the_output_gate_is_sigmoid_times():
    gen = torch.Generator().manual_seed(6)
    x, gate = torch.randn(5, 40, generator=gen), torch.randn(5, 40, generator=gen) * 4
    out = x.clone()
    assert fused_cpu.gate_mul_takes(out, gate)
    fused_cpu.gate_mul_(out, gate)
    torch.testing.assert_close(out, x * torch.sigmoid(gate), rtol=2e-7, atol=1e-7)


def test_the_binding_checks_a_deltanet_op(family_models):
    from pagecli import LLM

    llm = LLM(str(family_models["qwen3_5"]), dtype="float32", block_size=4)
    model = llm.engine.runner.model
    hidden = torch.zeros(1, model.config.hidden_size)
    ropes = {key: rotary(torch.tensor([0])) for key, rotary in model.rotary.items()}
    program = model.native_layers(hidden, ropes)
    assert program is not None
    index = next(i for i, op in enumerate(program.ops) if isinstance(op, ops.DeltaNet))
    op = program.ops[index]

    def bind(**changes):
        changed = list(program.ops)
        changed[index] = dataclasses.replace(op, **changes)
        return layers_cpu.LayerProgram(changed, program.widths, program.rotary_dims,
                                       torch.float32)  # fmt: skip

    assert bind().num_ops == program.num_ops
    for bad in (
        {"conv_weight": op.conv_weight[:, :1].contiguous()},  # a kernel of 1
        {"a": op.a[:1]},
        {"ssm_states": op.ssm_states.transpose(-1, -2)},  # not contiguous
        {"conv_states": op.conv_states.double()},
        {"num_v_heads": 3},  # not a multiple of the key heads
    ):
        with pytest.raises(ValueError, match="Gated DeltaNet"):
            bind(**bad)
    with pytest.raises(ValueError, match="whole rows"):
        layers_cpu.LayerProgram(program.ops, {**program.widths, "mixed": 7},
                                program.rotary_dims, torch.float32)  # fmt: skip
    tables = [(cos[:, 0], sin[:, 0]) for cos, sin in (ropes[k] for k in model.rope_keys)]
    block = torch.tensor([[[0]]], dtype=torch.int32)
    groups = [layers_cpu.AttentionGroup(0, 1, block, torch.tensor([1], dtype=torch.int32), None)]
    with pytest.raises(ValueError, match="state slots"):
        program(hidden, tables, torch.tensor([0]), groups)
    bad_slot = torch.tensor([10**6])
    with pytest.raises(ValueError, match="recurrent state slot"):
        program(hidden, tables, torch.tensor([0]), groups, None, bad_slot,
                torch.tensor([0, 1], dtype=torch.int32))  # fmt: skip
