"""The layer program (pagecli_kernels/layers_cpu.py) against the per-layer loop.

The C interpreter strings together the loop's own kernels with the same arguments, order and
thread count, so a run through it must give the loop's results bit for bit: the same greedy
ids and the same log-probabilities, exactly. The workload mixes chunked prefills with decodes (a
64-token step budget), hits the prefix cache, and is preempted (a small KV cache); the tiny
GGUF files cover every block format and a Q4_K_M layout (q/k/v of two formats), and tiny
float32 checkpoints the float rows. Files or settings the C loop does not take (a projection
with a float part, another attention implementation) fall back to the loop.
"""

from __future__ import annotations

import pytest
import torch

from pagecli import LLM, SamplingParams
from pagecli_kernels import layers_cpu, native, quant_cpu
from pagecli_kernels.quant_formats import QuantWeight, concat_rows
from pagecli_kernels.settings import kernel_settings
from tests.gguf_models import FORMATS, VOCAB, build_tiny_ggufs
from tests.tiny_models import kv_memory

pytestmark = pytest.mark.skipif(
    not native.enabled(), reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

LENGTHS = [1, 3, 9, 31, 64, 150]


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    return build_tiny_ggufs(tmp_path_factory.mktemp("gguf"))


def _prompts() -> list[dict]:
    gen = torch.Generator().manual_seed(7)  # tokens of every tiny vocabulary (384)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    shared = prompts[-1][:120]  # two prompts that share 120 tokens: a prefix-cache hit
    prompts += [shared + [5, 6, 7], shared + [8, 9]]
    return [{"prompt_token_ids": p} for p in prompts]


def _run(path, on: bool, **options) -> tuple[LLM, list[tuple]]:
    """A fresh engine (so that neither run finds the other's prefixes cached) over the
    workload, with the C loop on or off: its greedy ids and log-probabilities. `options`
    change the engine's (float32, blocks of 4 tokens, 64-token steps, 48 blocks)."""
    # the KV memory of 48 blocks of 4 tokens for 8 prompts of up to 162 tokens (of 32 with
    # window tables, which give back what they no longer read): sequences get preempted
    from transformers import AutoConfig

    defaults = dict(dtype="float32", block_size=4, max_num_batched_tokens=64, num_kv_blocks=48)
    config = AutoConfig.from_pretrained(str(path)) if path.is_dir() else None  # (GGUFs)
    if getattr(config, "sliding_window", None):
        value_bytes = 2 if options.get("dtype") == "bfloat16" else 4
        defaults.pop("num_kv_blocks")
        # gpt-oss's window of 128 spans most prompts here: its layers hold what full ones do
        blocks = 32 if config.sliding_window < 128 else 48
        defaults["kv_cache_memory"] = kv_memory(config, blocks, 4, value_bytes)
    options = {**defaults, **options}
    llm = LLM(str(path), **options)
    with kernel_settings(layers=on):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
        outputs = llm.generate(_prompts(), params)
    return llm, [
        (o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
        for o in outputs
    ]


def _counting(monkeypatch) -> list[int]:
    calls = [0]
    original = layers_cpu.LayerProgram.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(layers_cpu.LayerProgram, "__call__", counted)
    return calls


@pytest.mark.parametrize("kind", [*FORMATS, "q4_k_m"])
def test_layers_equal_the_loop_bit_for_bit(tiny_ggufs, kind, monkeypatch):
    calls = _counting(monkeypatch)
    llm, native_run = _run(tiny_ggufs[kind], True)
    used = calls[0]
    stats = llm.engine.stats()
    assert stats.preemptions_recompute > 0 and stats.chunked_prefills > 0
    assert stats.prefix_hit_tokens > 0
    _, loop_run = _run(tiny_ggufs[kind], False)
    assert used > 0 and calls[0] == used  # the first run took the C loop, the second did not
    assert native_run == loop_run


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2"])
def test_float32_checkpoints_take_the_layers_bit_for_bit(tiny_models, name, monkeypatch):
    # safetensors float32 weights run as F32 rows (quant_formats.F32) through the same C loop
    calls = _counting(monkeypatch)
    llm, native_run = _run(tiny_models[name], True)
    assert llm.engine.runner.model.weight_formats["o_proj"] == ["float32"]
    used = calls[0]
    _, loop_run = _run(tiny_models[name], False)
    assert used > 0 and calls[0] == used
    assert native_run == loop_run


@pytest.mark.parametrize(
    "name",
    ["gemma3", "phi3", "smollm3", "olmo2", "granite", "ministral", "qwen3_5"],
)
def test_every_family_takes_the_program_bit_for_bit(family_models, name, monkeypatch):
    # the program of each family (sandwich and post norms, q/k norms per head and over the
    # whole projection, partial and no rotary, LongRoPE, windows, multipliers, gelu-tanh,
    # Qwen3.5's Gated DeltaNet layers with their state slots and its gated attention)
    # against the loop of the same layers, with chunked prefills, preemption, prefix hits
    calls = _counting(monkeypatch)
    llm, native_run = _run(family_models[name], True)
    used = calls[0]
    stats = llm.engine.stats()
    assert stats.preemptions_recompute > 0 and stats.prefix_hit_tokens > 0
    _, loop_run = _run(family_models[name], False)
    assert used > 0 and calls[0] == used
    assert native_run == loop_run


@pytest.mark.parametrize(
    "name", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_5_moe", "gpt_oss"]
)
def test_moe_families_take_the_program_bit_for_bit(moe_models, name, monkeypatch):
    # the MoE op (router, top k, each chosen expert once over its gathered rows, a shared
    # expert) in the program against the loop, which runs the same native MoE per layer
    calls = _counting(monkeypatch)
    llm, native_run = _run(moe_models[name], True)
    used = calls[0]
    assert llm.engine.stats().preemptions_recompute > 0
    _, loop_run = _run(moe_models[name], False)
    assert used > 0 and calls[0] == used
    assert native_run == loop_run


@pytest.mark.parametrize("gemm", ["tiles", "pairs", "float32", "off"])
@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_bfloat16_steps_take_the_layers_bit_for_bit(tiny_models, name, gemm, monkeypatch):
    # bfloat16: the C loop rounds where the loop's bfloat16 tensors round. With the pair GEMM,
    # the float32 panels or AMX's tiles it takes every step (these are short); without any,
    # only the steps of at most 8 tokens (the row kernels: two sequences decoding), and the
    # prefill chunks in between run the loop. Both runs must agree to the bit.
    if gemm == "tiles" and not quant_cpu.bf16_tiles():
        pytest.skip("this CPU (or its kernel) has no AMX tiles")
    calls = _counting(monkeypatch)
    options = dict(dtype="bfloat16", max_num_seqs=2 if gemm == "off" else 8)
    with kernel_settings(bf16_gemm=gemm):
        llm, native_run = _run(tiny_models[name], True, **options)
        used = calls[0]
        _, loop_run = _run(tiny_models[name], False, **options)
    model = llm.engine.runner.model
    assert model.layers[0].mlp.down_proj.single_weight.format.name == "bfloat16"
    # without a native GEMM, most of the 8 x 11 decode steps of two sequences took the C loop
    assert used >= (8 * 11 // 2 if gemm == "off" else 11) and calls[0] == used
    assert native_run == loop_run


@pytest.mark.parametrize("name", ["gemma3", "olmo2", "granite", "phi3"])
def test_bfloat16_families_take_the_program_bit_for_bit(family_models, name, monkeypatch):
    # bfloat16 rounds where each norm style rounds ((1 + w) and OLMo's weight in float32,
    # Llama's after), where the multipliers and gelu round, and LongRoPE's tables
    calls = _counting(monkeypatch)
    options = dict(dtype="bfloat16", max_num_seqs=2)
    llm, native_run = _run(family_models[name], True, **options)
    used = calls[0]
    _, loop_run = _run(family_models[name], False, **options)
    assert used > 0 and calls[0] == used
    assert native_run == loop_run


def test_bfloat16_activations_over_gguf_blocks_bit_for_bit(tiny_ggufs, monkeypatch):
    # --dtype bfloat16 on a GGUF file: block-format projections (layers/quant_linear.py) widen
    # their bfloat16 input and round their float32 sums, in the C loop as in the Python one
    calls = _counting(monkeypatch)
    options = dict(dtype="bfloat16", max_num_seqs=2)
    llm, native_run = _run(tiny_ggufs["q4_k"], True, **options)
    assert llm.engine.runner.model.weight_formats["o_proj"] == ["q4_k"]
    used = calls[0]
    assert used > 0 and _run(tiny_ggufs["q4_k"], False, **options)[1] == native_run
    assert calls[0] == used


def test_a_projection_with_a_float_part_runs_the_loop(tiny_ggufs, monkeypatch):
    calls = _counting(monkeypatch)
    llm = LLM(str(tiny_ggufs["mixed"]), dtype="float32", block_size=4)
    outputs = llm.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=4))
    assert all(o.token_ids for o in outputs)
    assert calls[0] == 0


def test_the_reference_attention_runs_the_loop(tiny_ggufs, monkeypatch):
    calls = _counting(monkeypatch)
    llm = LLM(str(tiny_ggufs["q4_1"]), dtype="float32", block_size=4, attention_impl="reference")
    outputs = llm.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_tokens=4))
    assert all(o.token_ids for o in outputs)
    assert calls[0] == 0


def _one_token_step(llm: LLM):
    model = llm.engine.runner.model
    hidden = torch.zeros(1, model.config.hidden_size)
    ropes = {key: rotary(torch.tensor([0])) for key, rotary in model.rotary.items()}
    layers = model.native_layers(hidden, ropes)
    assert layers is not None
    tables = [(cos[:, 0], sin[:, 0]) for cos, sin in (ropes[k] for k in model.rope_keys)]
    return layers, hidden, tables


def test_bad_slots_and_block_ids_are_errors(tiny_ggufs):
    llm = LLM(str(tiny_ggufs["q8_0"]), dtype="float32", block_size=4, num_kv_blocks=16)
    layers, hidden, ropes = _one_token_step(llm)

    def group(block: int) -> list[layers_cpu.AttentionGroup]:
        tables = torch.tensor([[block]], dtype=torch.int32)
        return [layers_cpu.AttentionGroup(0, 1, tables, torch.tensor([1], dtype=torch.int32), None)]

    normed = layers(hidden, ropes, torch.tensor([0]), group(0))  # a valid step runs
    assert torch.isfinite(hidden).all()
    # the model's last norm, computed in the same call: the Python RMSNorm's bits
    assert torch.equal(normed, llm.engine.runner.model.norm(hidden))
    with pytest.raises(ValueError, match="slot"):
        layers(hidden, ropes, torch.tensor([16 * 4]), group(0))
    with pytest.raises(ValueError, match="block id"):
        layers(hidden, ropes, torch.tensor([0]), group(16))
    tables = torch.tensor([[0]], dtype=torch.int32)
    too_long = torch.tensor([5], dtype=torch.int32)  # more tokens than one block of 4 holds
    with pytest.raises(ValueError, match="seq_lens"):
        layers(
            hidden,
            ropes,
            torch.tensor([0]),
            [layers_cpu.AttentionGroup(0, 1, tables, too_long, None)],
        )
    with pytest.raises(ValueError, match="hidden must be"):
        layers(torch.zeros(1, hidden.shape[1] + 1), ropes, torch.tensor([0]), group(0))
    with pytest.raises(ValueError, match="cos/sin"):
        layers(hidden, [(ropes[0][0][:, :2], ropes[0][1][:, :2])], torch.tensor([0]), group(0))


def test_the_binding_checks_every_size_the_c_loop_reads(tiny_ggufs):
    import dataclasses

    from pagecli_kernels import layer_ops

    llm = LLM(str(tiny_ggufs["q4_0"]), dtype="float32", block_size=4, num_kv_blocks=16)
    layers, *_ = _one_token_step(llm)
    ops = layers.ops

    def bind(program, **changes):
        options = dict(widths=layers.widths, rotary_dims=layers.rotary_dims, dtype=torch.float32)
        options.update(changes)
        return layers_cpu.LayerProgram(program, **options)

    assert bind(ops).num_ops == len(ops)
    linears = [i for i, op in enumerate(ops) if isinstance(op, layer_ops.Linear)]
    qkv_index, o_index = linears[0], linears[1]
    qkv, o = ops[qkv_index], ops[o_index]
    swapped = list(ops)
    swapped[qkv_index] = dataclasses.replace(qkv, parts=o.parts)  # o is [H, Q]
    with pytest.raises(ValueError, match="projection parts"):
        bind(swapped)
    assert len(qkv.parts) == 3  # a QuantLinear's parts: q, k, v as the file holds them
    whole = concat_rows(list(qkv.parts))  # one buffer, cut into parts below
    rows = whole.rows // (layers_cpu.MAX_PARTS + 1)

    def with_parts(*bounds):
        parts = tuple(QuantWeight(whole.format, whole.data[a:b], whole.cols) for a, b in bounds)
        changed = list(ops)
        changed[qkv_index] = dataclasses.replace(qkv, parts=parts)
        return changed

    assert bind(with_parts((0, 2 * rows), (2 * rows, whole.rows)))
    for bad in (
        with_parts((0, rows), (rows, whole.rows - 1)),
        with_parts(*[(i * rows, (i + 1) * rows) for i in range(layers_cpu.MAX_PARTS + 1)]),
    ):
        with pytest.raises(ValueError, match="parts"):  # a row short; more than MAX_PARTS
            bind(bad)
    short_bias = list(ops)
    short_bias[qkv_index] = dataclasses.replace(qkv, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="bias"):
        bind(short_bias)
    with pytest.raises(ValueError, match="whole rows"):  # a projection into a narrow buffer
        bind(ops, widths={**layers.widths, "qkv": layers.widths["qkv"] + 1})
    norms = [i for i, op in enumerate(ops) if isinstance(op, layer_ops.Norm)]
    bad_norm = list(ops)
    bad_norm[norms[0]] = dataclasses.replace(ops[norms[0]], weight=torch.ones(3))
    with pytest.raises(ValueError, match="norm weight"):
        bind(bad_norm)
    outside = list(ops)
    outside[norms[0]] = dataclasses.replace(ops[norms[0]], dst_col=1)  # past the row's end
    with pytest.raises(ValueError, match="outside buffer"):
        bind(outside)
    attention = next(i for i, op in enumerate(ops) if isinstance(op, layer_ops.Attention))
    bad_sinks = list(ops)
    bad_sinks[attention] = dataclasses.replace(ops[attention], sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        bind(bad_sinks)
    with pytest.raises(ValueError, match="final norm"):
        bind(ops, final_norm=torch.ones(3), final_eps=1e-5)
    with pytest.raises(ValueError, match="attention op"):
        bind([op for op in ops if not isinstance(op, layer_ops.Attention)])
