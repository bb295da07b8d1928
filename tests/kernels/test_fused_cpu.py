"""The fused native small ops (pagecli_kernels/fused_cpu.py) against the torch code they
replace, in float32 and bfloat16, at odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagecli_kernels import fused_cpu, native, reference
from pagecli_kernels.settings import kernel_settings

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.fixture(autouse=True)
def built():
    if native.library() is None:
        pytest.fail(f"the native CPU kernel did not build: {native.unavailable_reason()}")


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOL[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _torch_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (3, 64), (33, 100)])
def test_rms_norm_and_residual_add(dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen).to(dtype)
    delta = torch.randn(shape, generator=gen).to(dtype)
    weight = (torch.rand(shape[1], generator=gen) + 0.5).to(dtype)
    _close(fused_cpu.rms_norm(x.clone(), weight, 1e-6), _torch_rms_norm(x, weight, 1e-6))
    summed = x.clone()
    normed = fused_cpu.rms_norm(summed, weight, 1e-5, residual_delta=delta)
    torch.testing.assert_close(summed, x + delta, atol=0, rtol=0)  # the add rounds as torch's
    _close(normed, _torch_rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views(dtype):
    from pagecli.layers.rotary import _rotate_half

    gen = torch.Generator().manual_seed(0)
    num_tokens, num_q_heads, num_k_heads, head_dim = 5, 3, 1, 64
    width = (num_q_heads + 2 * num_k_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)  # [T, (Hq + 2 Hk) D]
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_k_heads) * head_dim]
    k = k.view(num_tokens, num_k_heads, head_dim)
    v_before = qkv[:, (num_q_heads + num_k_heads) * head_dim :].clone()
    angles = torch.rand(num_tokens, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # [T, D]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    expected_q = q * c + _rotate_half(q) * s
    expected_k = k * c + _rotate_half(k) * s
    assert fused_cpu.rotary_supported(q, k)
    fused_cpu.rotary_(q, k, cos, sin)
    # elementwise ops round as torch's: equal, not just close
    torch.testing.assert_close(q, expected_q, atol=0, rtol=0)
    torch.testing.assert_close(k, expected_k, atol=0, rtol=0)
    assert torch.equal(qkv[:, (num_q_heads + num_k_heads) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_llama_cpp_pairs_gives_the_unpermuted_rows_rotated(dtype, monkeypatch):
    """A GGUF's Q/K rows read in place give each head's rotary halves interleaved; the
    kernel (and the torch fallback) must give exactly what unpermuted weights give."""
    from pagecli.layers.rotary import apply_rotary
    from pagecli.loader.gguf_weights import unpermute_qk

    gen = torch.Generator().manual_seed(1)
    num_tokens, num_q_heads, num_k_heads, head_dim = 4, 4, 2, 32
    q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_k_heads) * head_dim
    halves = torch.randn(num_tokens, k_end + num_k_heads * head_dim, generator=gen).to(dtype)

    def to_pairs(x, heads):  # llama.cpp's permutation of rows, applied to their outputs
        return x.view(num_tokens, heads, 2, head_dim // 2).transpose(2, 3).flatten(1)

    pairs = halves.clone()
    pairs[:, :q_end] = to_pairs(halves[:, :q_end], num_q_heads)
    pairs[:, q_end:k_end] = to_pairs(halves[:, q_end:k_end], num_k_heads)
    assert not torch.equal(pairs, halves)  # the loader's unpermute is its inverse:
    assert torch.equal(unpermute_qk(pairs[:, :q_end].T, num_q_heads).T, halves[:, :q_end])
    angles = torch.rand(num_tokens, head_dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # [T, D]

    def views(t):
        q = t[:, :q_end].view(num_tokens, num_q_heads, head_dim)
        return q, t[:, q_end:k_end].view(num_tokens, num_k_heads, head_dim)

    expected = views(halves.clone())
    fused_cpu.rotary_(*expected, cos, sin)
    got = views(pairs.clone())
    fused_cpu.rotary_(*got, cos, sin, pairs=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(fused_cpu, "rotary_supported", lambda q, k: False)  # torch's ops
    fallback = apply_rotary(*views(pairs.clone()), cos.unsqueeze(1), sin.unsqueeze(1), True)
    for a, b in zip(fallback, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17])
def test_silu_mul(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 150, generator=gen) * 8).to(dtype)  # big |g| both ways
    gate, up = gate_up.split(150, dim=-1)
    _close(fused_cpu.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17])
def test_swiglu_oai_clamps_as_gpt_oss_does(dtype, rows):
    # transformers' GptOssExperts._apply_gate on gate and up apart: values past the limit
    # of 7 both ways, so each clamp is exercised
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 150, generator=gen) * 8).to(dtype)
    gate, up = gate_up.split(150, dim=-1)
    assert (gate > 7).any() and (up < -7).any() and (up > 7).any()
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    expected = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    _close(fused_cpu.swiglu_oai(gate_up, 1.702, 7.0), expected)


def test_argmax_first_maximum_and_nan():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=gen)
    logits[3, 10] = logits[3, 20] = 100.0  # a tie: the first index wins, as in torch
    logits[5, 7] = float("nan")  # a NaN wins, as in torch
    logits[6] = float("-inf")
    torch.testing.assert_close(fused_cpu.argmax(logits), logits.argmax(dim=-1))
    assert int(fused_cpu.argmax(logits)[3]) == 10
    strided = logits[:, :1000]
    torch.testing.assert_close(fused_cpu.argmax(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_rows_into_a_strided_layer_view(dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    both = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    both = both.to(dtype)
    k_cache, v_cache = both[0], both[1]
    key = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    value = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    slots = torch.tensor([13, 0, -1, 7, 19, -5], dtype=torch.int64)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, expected_k, expected_v, slots)
    assert fused_cpu.store_kv(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, expected_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, equal_nan=True, atol=0, rtol=0)
    with pytest.raises(ValueError, match="past the cache"):
        fused_cpu.store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, 20]))


def test_fused_ops_follow_the_native_switch():
    x = torch.randn(2, 8)
    assert fused_cpu.available(x)
    assert not fused_cpu.available(x.double())
    with kernel_settings(native=False):
        assert not fused_cpu.available(x)
