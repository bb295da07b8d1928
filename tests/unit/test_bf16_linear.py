"""bfloat16 linear layers on the CPU (layers/linear.BF16Linear): decode-sized products on the
native row kernels (up to `quant_cpu.fused_rows()` rows, where each row has the bits it has
alone), larger ones on the pair GEMM, AMX's tiles or the float32 panels where one is chosen,
float32 sums rounded once to bfloat16; without one, larger ones exactly torch's."""

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
    """Set the kernels' choice for larger batches for one test ("pairs", "off", "tiles",
    "float32")."""
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
    [(1, "off"), (2, "off"), (8, "off"), (1, "pairs"), (3, "pairs"), (9, "pairs"), (64, "pairs")]
    + [(9, "float32"), (64, "float32"), (9, "tiles"), (64, "tiles"), (256, "tiles")],
)
def test_native_products_round_once(rows, gemm, bias, bf16_gemm, monkeypatch):
    # the row kernels (up to 8 rows), the pair GEMM, the float32 panels, and AMX's tiles up to
    # TILES_ROWS rows
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


@pytest.mark.parametrize("rows", [9, 64])
def test_larger_batches_without_a_native_gemm_are_torch_gemm(rows, bf16_gemm, monkeypatch):
    bf16_gemm("off")
    weight, b = make(70, 96, bias=True)
    layer = BF16Linear(weight, b)
    calls = _counted(monkeypatch)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    assert torch.equal(layer(x), F.linear(x, weight, b))
    assert calls == [] and quant_cpu.fused_rows() == 8
    assert BF16Linear.native_takes(8) and not BF16Linear.native_takes(9)


@pytest.mark.parametrize("gemm", ["off", "pairs", "float32", "tiles"])
@pytest.mark.parametrize("fused_rows", [0, 17])
def test_a_row_has_the_bits_it_has_alone_up_to_fused_rows(gemm, fused_rows, bf16_gemm, monkeypatch):
    """Speculative decoding's verify rows in bfloat16: a batch of 2 to `quant_cpu.fused_rows()`
    rows (8, or 17 = 1 + 16 drafts where a step asks for it) takes the row kernels whatever
    takes larger batches (torch's GEMM under "off", whose rows depend on their batch), and
    each row's float32 sums are bit for bit those of its row alone (compared before the
    rounding to bfloat16, which would hide most differences of order)."""
    if gemm == "tiles" and not quant_cpu.bf16_tiles():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    bf16_gemm(gemm)
    weight, _ = make(200, 1024, bias=False)
    layer = BF16Linear(weight, None)
    sums = quant_cpu.bf16_linear
    calls = _counted(monkeypatch)
    with kernel_settings(fused_rows=fused_rows):
        most = quant_cpu.fused_rows()
        assert most == (fused_rows or 8)
        x = torch.randn(most, 1024, generator=torch.Generator().manual_seed(most)).bfloat16()
        alone = torch.cat([sums(x[i : i + 1], layer.single_weight) for i in range(most)])
        for m in range(2, most + 1):
            got = sums(x[:m], layer.single_weight)
            assert torch.equal(got.view(torch.int32), alone[:m].view(torch.int32)), m
            assert torch.equal(layer(x[:m]), alone[:m].bfloat16())
    assert calls == list(range(2, most + 1))  # the layer took the native kernels every time


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


@pytest.mark.parametrize("name", ["qwen2", "llama3"])  # a tied head, an untied one
def test_a_bfloat16_checkpoint_in_float32_keeps_bfloat16_rows(
    tiny_models, tmp_path, name, monkeypatch
):
    """A bfloat16 checkpoint run in float32 (`--dtype auto` on a CPU without native
    bfloat16) keeps its projections and embedding as bfloat16 rows: the same logprobs, bit
    for bit, as with the float32 rows they widen to, from half the weight bytes."""
    from transformers import AutoModelForCausalLM

    from pagecli import LLM, SamplingParams
    from pagecli.models import weight_methods

    path = tmp_path / name
    model = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}, {"prompt_token_ids": [2, 7]}]

    def run():
        llm = LLM(str(path), dtype="float32", num_kv_blocks=32, max_num_seqs=2)
        outputs = llm.generate(prompts, params)
        logprobs = [[(lp.logprob, lp.top) for lp in o.outputs[0].logprobs] for o in outputs]
        runner = llm.engine.runner
        return runner.model, logprobs, (llm.engine.stats().weight_bytes, runner.memory.anonymous)

    halves, want_logprobs, bf16_bytes = run()
    assert set(sum(halves.weight_formats.values(), [])) <= {"bfloat16", "tied"}
    assert isinstance(halves.embed_tokens, weight_methods.QuantEmbedding)
    monkeypatch.setattr(weight_methods, "_bfloat16_values", lambda t: False)  # float32 rows
    whole, got_logprobs, f32_bytes = run()
    assert set(sum(whole.weight_formats.values(), [])) <= {"float32", "tied"}
    assert got_logprobs == want_logprobs
    # the weights read and held (the memory line's "own"): about half
    assert bf16_bytes[0] < 0.55 * f32_bytes[0] and bf16_bytes[1] < 0.55 * f32_bytes[1]
