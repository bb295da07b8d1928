"""The mixture-of-experts families against transformers on the same random weights.

Qwen3-MoE (top 2 of 8 renormalized, a dense layer among the sparse ones), Qwen2-MoE (a gated
shared expert, q/k/v bias), Mixtral (its own tensor names), OLMoE (top 3 of 8, q/k norm over
the whole projection), Qwen3.5-MoE and gpt-oss (the top 2 of its biased logits softmaxed,
experts with biases and the clamped SwiGLU stacked in four tensors, attention sinks, a
window of 128 on alternate layers, YaRN) from safetensors; Qwen3-MoE, OLMoE, Mixtral (a llama
file with experts, its Q/K rows permuted), Qwen3.5-MoE and gpt-oss (gate and up apart, the
expert biases as [E, rows] stacks, MXFP4 experts too) from GGUF files as llama.cpp's
converter writes them (tests/gguf_families.py: 3-D expert stacks of Q8_0 blocks, read as each
expert's rows of the file's map). Mixed batches with chunked prefills (rows of one step route
to different experts; prompts of 150 tokens, past gpt-oss's window), preemption (recompute
and swap) with prefix hits, tensor parallelism at 2 (each expert's columns split), and the
refusals: an expert count the tensors contradict, a router pagecli does not know.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagecli import LLM, SamplingParams
from tests.oracle import check_greedy, check_logprobs
from tests.tiny_models import VOCAB

NEW_TOKENS = 12
TOP = 5
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_5_moe", "gpt_oss"]
GGUF_ARCHS = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama",
              "qwen3_5_moe": "qwen35moe", "gpt_oss": "gpt-oss"}  # fmt: skip


def prompts_of(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def moe_ggufs(moe_models, tmp_path_factory):
    """family -> (GGUF path, reference folder): Qwen3-MoE without its dense layer (a qwen3moe
    file says nothing of mlp_only_layers: every layer is sparse), OLMoE and Mixtral."""
    from tests.gguf_families import write_family_gguf
    from tests.tiny_models import build_tiny_models, moe_configs

    config = moe_configs()["qwen3_moe"]
    config.mlp_only_layers = []
    root = tmp_path_factory.mktemp("moe_gguf")
    models = {**moe_models, **build_tiny_models(root / "models", {"qwen3_moe": config})}
    return {
        name: write_family_gguf(models[name], root / name, arch, "q8_0")
        for name, arch in GGUF_ARCHS.items()
    }


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _routes(hf) -> list[set[int]]:
    """Hooks transformers' routers: the experts each of its forward passes chose (a set per
    pass and layer), the same choices pagecli's rows face."""
    chosen: list[set[int]] = []

    def hook(module, args, output):
        chosen.append(set(output[-1].unique().tolist()))  # (logits, weights, experts)

    for module in hf.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.register_forward_hook(hook)
    return chosen


def _run_and_check(path, hf) -> LLM:
    routes = _routes(hf)
    prompts = prompts_of(1, [1, 9, 31, 64, 100, 150])
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    assert llm.engine.stats().chunked_prefills > 0
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == NEW_TOKENS
        check_greedy(hf, prompt, output.token_ids)
        check_logprobs(hf, prompt, output, TOP)
    # the sequences' tokens (a step's rows) route to many experts, not one top-k set
    assert max(len(c) for c in routes) > hf.config.num_experts_per_tok
    return llm


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_family_parity(moe_models, name):
    _run_and_check(moe_models[name], _hf(moe_models[name]))


@pytest.mark.parametrize("name", list(GGUF_ARCHS))
def test_moe_gguf_parity_with_experts_in_the_files_map(moe_ggufs, name):
    path, reference = moe_ggufs[name]
    llm = _run_and_check(path, _hf(reference))
    model = llm.engine.runner.model
    assert model.weight_formats["gate_up_proj"] == ["q8_0"]
    for kind in ("gate_up_proj", "down_proj"):  # every expert a view of one stack's storage
        parts = [getattr(e, kind).parts[0] for e in model.layers[0].mlp.experts]
        storages = {p.data.untyped_storage().data_ptr() for p in parts}
        assert len(storages) == 1
        starts = [p.data.data_ptr() for p in parts]
        assert starts == sorted(starts) and len(set(starts)) == len(parts)


@pytest.mark.parametrize(
    ("family", "fmt"),
    [
        ("olmoe", "bf16"),
        ("olmoe", "mxfp4"),
        ("olmoe", "iq4_nl"),
        ("olmoe", "iq4_xs"),
        ("gpt_oss", "mxfp4"),
    ],
)
def test_expert_stacks_stay_in_their_format(moe_models, family, fmt, tmp_path):
    """GGUFs whose experts are BF16 (kept as many MoE uploads keep them), MXFP4 (gpt-oss's
    experts), IQ4_NL or IQ4_XS (the "dynamic" quants'): every expert stays in that format,
    rows of the
    file's map, not float32, and the output is transformers' on the same values."""
    from tests.gguf_families import write_family_gguf

    arch = GGUF_ARCHS[family]
    model = moe_models[family]
    if fmt == "iq4_xs":  # super-blocks of 256: the experts' rows and columns that wide
        from tests.tiny_models import wide_moe_model

        model = wide_moe_model(tmp_path / "wide", family)
    path, reference = write_family_gguf(model, tmp_path, arch, fmt)
    llm = _run_and_check(path, _hf(reference))
    name = {"bf16": "bfloat16"}.get(fmt, fmt)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert all(e.gate_up_proj.formats == [name, name] for e in experts)
    assert all(e.down_proj.formats == [name] for e in experts)
    assert llm.engine.runner.memory.mapped > 0.9 * llm.engine.runner.weight_bytes


def test_gpt_oss_prompts_reach_past_its_window_and_sinks(moe_models):
    """The parity prompts exercise what gpt-oss adds: on the 150-token prompt transformers'
    own logits change when the window of 128 or the sinks are taken away, so pagecli's match
    with them (test_moe_family_parity) holds only if it applies both."""
    from transformers import GptOssForCausalLM

    path = moe_models["gpt_oss"]
    prompt = torch.tensor([prompts_of(1, [1, 9, 31, 64, 100, 150])[-1]])

    def last_logits(hf) -> torch.Tensor:
        with torch.no_grad():
            return hf(prompt).logits[0, -1]

    hf = _hf(path)
    assert hf.config.sliding_window == 128 and "sliding_attention" in hf.config.layer_types
    base = last_logits(hf)
    for layer in hf.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) is 0: no sink
    sinkless = last_logits(hf)
    windowless = last_logits(
        GptOssForCausalLM.from_pretrained(str(path), dtype=torch.float32, sliding_window=4096)
    )
    assert (base - sinkless).abs().max() > 1e-2
    assert (base - windowless).abs().max() > 1e-2


def test_gpt_oss_drafts_keep_every_logprob_past_the_split_size(moe_models):
    """Speculative decoding on gpt-oss (sinks, a window of 128): prompts of 240-250 tokens
    decode past 256, where attention cuts a context into splits (two threads) and a step of
    verify rows does what a lone decode before 256 does not. Every logprob is the same with
    drafts and without; the first split holds the sink, as an unsplit context does."""
    base = prompts_of(4, [24])[0]
    prompts = [(base * 11)[:240], (base * 11)[3:253]]  # repeats: n-gram drafts find them
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=TOP)
    runs = []
    for spec in (None, {"num_speculative_tokens": 4}):
        llm = LLM(str(moe_models["gpt_oss"]), dtype="float32", num_threads=2, max_num_seqs=1,
                  speculative_config=spec)  # fmt: skip
        runs.append(llm.generate([{"prompt_token_ids": p} for p in prompts], params))
        stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > 0
    for off, on in zip(*runs):
        assert on.token_ids == off.token_ids
        want, got = off.outputs[0].logprobs, on.outputs[0].logprobs
        assert [(lp.logprob, lp.top) for lp in got] == [(lp.logprob, lp.top) for lp in want]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_moe_under_preemption_and_prefix_hits(moe_models, mode):
    path = moe_models["qwen3_moe"]
    hf = _hf(path)
    shared = prompts_of(2, [48])[0]
    prompts = prompts_of(3, [20, 40, 60, 80]) + [shared + [5, 6, 7], shared + [8, 9]]
    extra = {"preemption_mode": "swap", "swap_space": 0.01} if mode == "swap" else {}
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=32, **extra)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    assert stats.prefix_hit_tokens > 0
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)


@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_experts_quantize_at_load(moe_models, family):
    """--quantization q8_0 quantizes every expert's projections (and the router stays
    float32, as llama.cpp keeps ffn_gate_inp); gpt-oss's stacked experts are cut per expert
    before they are quantized, their biases kept in float32."""
    llm = LLM(str(moe_models[family]), dtype="float32", quantization="q8_0")
    model = llm.engine.runner.model
    moe = model.layers[0].mlp
    assert all(e.gate_up_proj.formats == ["q8_0", "q8_0"] for e in moe.experts)
    assert all(e.down_proj.formats == ["q8_0"] for e in moe.experts)
    assert getattr(moe.gate, "formats", None) == ["float32"]  # float32 rows of the cache
    if family == "gpt_oss":  # expert 3's gate and up biases, de-interleaved, in float32
        from safetensors import safe_open

        path = moe_models[family] / "model.safetensors"
        with safe_open(str(path), "pt") as f:
            stacked = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias")[3]
        want = torch.cat([stacked[0::2], stacked[1::2]])
        assert torch.equal(moe.experts[3].gate_up_proj.bias.data, want)
    (output,) = llm.generate(
        [{"prompt_token_ids": prompts_of(4, [30])[0]}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    assert len(output.token_ids) == 4  # fmt: skip


def test_bad_moe_inputs_are_one_line(moe_models, moe_ggufs, tmp_path):
    from pagecli.errors import ModelLoadError

    folder = tmp_path / "sigmoid-router"
    shutil.copytree(moe_models["qwen3_moe"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["scoring_func"] = "sigmoid"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="router scoring .sigmoid."):
        LLM(str(folder))
    fewer = tmp_path / "fewer-experts"
    shutil.copytree(moe_models["olmoe"], fewer)
    config = json.loads((fewer / "config.json").read_text())
    config["num_experts"] = 6
    (fewer / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="expert 6, but the config gives layer 0 6"):
        LLM(str(fewer), quantization="none")


def test_active_bytes_count_the_chosen_experts(moe_models):
    """`/stats` and bench report the weights' bytes and the bytes one decode token reads:
    every projection, each expert at top_k / experts (only the chosen experts' rows are read),
    one embedding row; counted here from the checkpoint's own tensors (float32)."""
    from safetensors import safe_open

    path = moe_models["olmoe"]
    llm = LLM(str(path), dtype="float32", quantization="none")
    config = llm.engine.hf_config
    share = config.num_experts_per_tok / config.num_experts
    total = active = 0.0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if len(shape) != 2:
                continue  # norms
            size = 4 * shape[0] * shape[1]
            total += size
            if name == "model.embed_tokens.weight":
                active += size / shape[0]  # one row
            else:
                active += size * (share if ".experts." in name else 1.0)
    stats = llm.engine.stats()
    assert stats.weight_bytes == int(total)
    assert stats.active_weight_bytes == int(active)
    assert stats.active_weight_bytes < 0.6 * stats.weight_bytes  # 3 of 8 experts


@pytest.fixture(scope="module")
def tp_moe_models(tmp_path_factory):
    """Qwen2-MoE (the experts' own width, a shared expert) and gpt-oss (expert biases, the
    width its config calls intermediate_size) with 64-column experts, so that each rank's
    32 columns take the native kernels and the one-call layer program."""
    from tests.tiny_models import build_tiny_models, moe_configs

    configs = moe_configs()
    configs["qwen2_moe"].moe_intermediate_size = 64
    configs["gpt_oss"].intermediate_size = 64
    chosen = {name: configs[name] for name in ("qwen2_moe", "gpt_oss")}
    return build_tiny_models(tmp_path_factory.mktemp("tp_moe"), chosen)


@pytest.mark.parametrize("name", ["qwen2_moe", "gpt_oss"])
def test_moe_tensor_parallel_splits_every_experts_columns(tp_moe_models, name):
    """At 2 ranks each holds half of every expert's columns (and of the shared expert's),
    the router whole; the MoE's output is all-reduced inside the layer program. Greedy
    tokens are transformers'."""
    path = tp_moe_models[name]
    hf = _hf(path)
    prompts = prompts_of(5, [1, 9, 31, 150])
    llm = LLM(str(path), tensor_parallel_size=2, num_threads=1, dtype="float32",
              block_size=4, max_num_batched_tokens=64)  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        llm.engine.check_invariants()
        tp = llm.engine.runner.tp
        assert tp.shm is not None and tp.shm.num_in_layers > 0  # the program's all-reduces
        moe = llm.engine.runner.model.layers[0].mlp
        assert all(e.gate_up_proj.out_features == 64 for e in moe.experts)  # 2 x 32
        assert all(e.down_proj.in_features == 32 for e in moe.experts)
        experts = getattr(hf.config, "num_experts", None) or hf.config.num_local_experts
        assert moe.gate.out_features == len(moe.experts) == experts  # the router whole
        if moe.shared_expert is not None:
            assert moe.shared_expert.down_proj.in_features == 32  # 64 over 2 ranks
    finally:
        llm.engine.close()
    for prompt, output in zip(prompts, outputs):
        check_greedy(hf, prompt, output.token_ids)


FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])  # fmt: skip


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] float -> transformers' MXFP4 (blocks [E, rows, cols / 32, 16], value
    2j in the low nibble of byte j; E8M0 scales [E, rows, cols / 32], 2^(scale - 127)), each
    32 values under the power of two that puts their largest magnitude at most at 6."""
    groups = w.reshape(*w.shape[:2], -1, 32)
    peak = groups.abs().amax(-1).clamp_min(1e-30)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-126, 127)
    unit = torch.pow(2.0, exponent)[..., None]
    distance = ((groups / unit)[..., None] - FP4_VALUES).abs()  # [E, rows, G, 32, 16]
    codes = distance.argmin(-1).to(torch.uint8)  # [E, rows, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(moe_models, tmp_path_factory):
    """gpt-oss as OpenAI released it: the experts' stacks in MXFP4 (`*_blocks`, `*_scales`),
    the config's quantization_config."""
    from safetensors.torch import load_file, save_file

    source = moe_models["gpt_oss"]
    released = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = load_file(str(source / "model.safetensors"))
    quantized = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _to_mxfp4(tensor.transpose(1, 2).contiguous())  # [E, out, in]
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        else:
            quantized[name] = tensor
    save_file(quantized, str(released / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (released / "config.json").write_text(json.dumps(config))
    return released


def test_gpt_oss_released_mxfp4_checkpoint_keeps_its_blocks(gpt_oss_mxfp4):
    """The released checkpoints' MXFP4 experts become GGUF's MXFP4 blocks at load, exactly
    (the same codes and exponents, repacked): greedy parity with transformers on the same
    checkpoint (its MXFP4 integration, dequantizing), every expert in mxfp4; under
    --quantization q8_0 they stay MXFP4 while the attention is quantized."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    released = gpt_oss_mxfp4
    hf = AutoModelForCausalLM.from_pretrained(
        str(released), dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    llm = _run_and_check(released, hf)
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert all(e.gate_up_proj.formats == ["mxfp4", "mxfp4"] for e in experts)
    assert all(e.down_proj.formats == ["mxfp4"] for e in experts)
    quantized = LLM(str(released), dtype="float32", quantization="q8_0")
    model = quantized.engine.runner.model
    assert model.weight_formats["qkv_proj"] == ["q8_0"]
    assert all(e.gate_up_proj.formats == ["mxfp4", "mxfp4"] for e in model.layers[0].mlp.experts)
    (output,) = quantized.generate(
        [{"prompt_token_ids": prompts_of(6, [20])[0]}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    )
    assert len(output.token_ids) == 4
