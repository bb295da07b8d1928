"""bfloat16 linear layers on the CPU (layers/linear.BF16Linear): decode-sized products on the
native row kernels, larger ones on the pair GEMM where it is chosen, float32 sums rounded once
to bfloat16; without the pair GEMM, larger ones exactly torch's."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagecli.layers.linear import BF16Linear, bf16_rows_supported, use_bf16_rows
from pagecli_kernels import quant_cpu
from pagecli_kernels.settings import kernel_settings

pytestmark = pytest.mark.skipif(
    not bf16_rows_supported(torch.bfloat16, torch.device("cpu")),
    reason="the native CPU kernels did not build",
)


def make(rows_out: int, cols: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows_out, cols, generator=gen).bfloat16()
    b = torch.randn(rows_out, generator=gen).bfloat16() if bias else None
    return weight, b


@pytest.fixture
def bf16_gemm():
    """Set the kernels' choice for larger batches for one test ("pairs", "off", "tiles")."""
    with contextlib.ExitStack() as stack:
        yield lambda choice: stack.enter_context(kernel_settings(bf16_gemm=choice))


def _counted(monkeypatch) -> list[int]:
    calls: list[int] = []
    kernel = quant_cpu.bf16_linear
    monkeypatch.setattr(
        quant_cpu, "bf16_linear", lambda x2d, w: calls.append(x2d.shape[0]) or kernel(x2d, w)
    )
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "gemm"),
    [(1, "off"), (2, "off"), (1, "pairs"), (3, "pairs"), (9, "pairs"), (64, "pairs")]
    + [(9, "tiles"), (64, "tiles"), (256, "tiles")],
)
def test_native_products_round_once(rows, gemm, bias, bf16_gemm, monkeypatch):
    # the row kernels (up to SMALL_ROWS rows, or 8 with a native GEMM), the pair GEMM, and
    # AMX's tiles up to TILES_ROWS rows
    if gemm == "tiles" and not quant_cpu.bf16_tiles():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    bf16_gemm(gemm)
    weight, b = make(70, 96, bias, seed=rows)
    layer = BF16Linear(weight, b)
    calls = _counted(monkeypatch)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = layer(x)
    assert calls == [rows] and got.dtype == torch.bfloat16 and got.shape == (rows, 70)
    want = x.double() @ weight.double().T + (b.double() if bias else 0)  # [rows, 70]
    scale = x.double().abs() @ weight.double().abs().T + (b.double().abs() if bias else 0)
    # one rounding to bfloat16 (half an ulp: at most 2^-8 relative) over float32 sums
    err = (got.double() - want).abs() - 2**-8 * want.abs()
    assert (err <= 2e-6 * scale).all(), err.max()
    # and leading dimensions
    x3 = x.view(1, rows, 96)
    assert torch.equal(layer(x3), got.view(1, rows, 70))


@pytest.mark.parametrize("rows", [3, 64])
def test_larger_batches_without_the_pair_gemm_are_torch_gemm(rows, bf16_gemm, monkeypatch):
    bf16_gemm("off")
    weight, b = make(70, 96, bias=True)
    layer = BF16Linear(weight, b)
    calls = _counted(monkeypatch)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    assert torch.equal(layer(x), F.linear(x, weight, b))
    assert calls == [] and not BF16Linear.native_takes(BF16Linear.SMALL_ROWS + 1)
    assert BF16Linear.native_takes(BF16Linear.SMALL_ROWS)


def test_tiles_leave_batches_past_their_rows_to_torch(bf16_gemm, monkeypatch):
    # oneDNN's GEMM on AMX outruns the tiles kernel from 512 rows on (BF16Linear.TILES_ROWS)
    if not quant_cpu.bf16_tiles():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    bf16_gemm("tiles")
    rows = BF16Linear.TILES_ROWS + 1
    weight, b = make(70, 96, bias=True)
    layer = BF16Linear(weight, b)
    calls = _counted(monkeypatch)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    assert torch.equal(layer(x), F.linear(x, weight, b))
    assert calls == [] and BF16Linear.native_takes(BF16Linear.TILES_ROWS)


def test_bf16_linear_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        BF16Linear(torch.zeros(4, 32), None)


def test_use_bf16_rows_replaces_the_bf16_linears_with_whole_blocks():
    model = nn.Sequential(
        nn.Linear(64, 32, dtype=torch.bfloat16),
        nn.Sequential(nn.Linear(32, 8, bias=False, dtype=torch.bfloat16)),
        nn.Linear(40, 8, dtype=torch.bfloat16),  # 40 columns: not whole 32-value blocks
        nn.Linear(64, 8),  # float32
    )
    weight = model[0].weight.data.clone()
    use_bf16_rows(model)
    assert isinstance(model[0], BF16Linear) and isinstance(model[1][0], BF16Linear)
    assert type(model[2]) is nn.Linear and type(model[3]) is nn.Linear
    assert torch.equal(model[0].weight, weight) and model[1][0].bias is None


def test_a_bfloat16_engine_takes_them_with_the_tied_head(tiny_models):
    from pagecli import LLM, SamplingParams

    llm = LLM(str(tiny_models["qwen2"]), dtype="bfloat16", num_kv_blocks=32)  # tied, qkv bias
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, BF16Linear)]
    assert len(linears) == 4 * len(model.layers)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    assert model.bf16_head is not None
    hidden = torch.randn(2, model.config.hidden_size).bfloat16()
    table = model.embed_tokens.weight
    want = F.linear(hidden.double(), table.double())  # [2, V]
    got = model.compute_logits(hidden)
    assert got.dtype == torch.float32
    err = (got.double() - want).abs() - 2**-8 * want.abs()
    assert (err <= 2e-6 * (hidden.double().abs() @ table.double().abs().T)).all()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], params)
    assert len(out.outputs[0].token_ids) == 6
