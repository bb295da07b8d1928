"""Tiny checkpoints of the families as GGUF files laid out as llama.cpp's converter lays them
out, each with a transformers reference folder holding the same values.

`write_family_gguf` reads a tiny safetensors checkpoint (tests/tiny_models.py) and writes:

- a GGUF file of one llama.cpp architecture: the converter's metadata keys for that arch
  (llama.cpp's conversion/*.py: TextModel.set_gguf_parameters, LlamaModel, Gemma3Model,
  Phi3MiniModel, GraniteModel, Olmo2Model), its tensor names (gguf's own
  `get_tensor_name_map`, which the converter uses), its stored conventions (Q/K rows
  permuted for the NORM-rope archs llama, smollm3 and granite, biases too; Gemma's
  `*norm.weight` stored as w + 1, in float32), Phi-3's LongRoPE factors as F32 tensors, the
  2-D weights in a block format (norms, biases and rope factors F32). No tokenizer (tests pass
  token ids): `{arch}.vocab_size` stands in for the tokenizer's token count where the
  converter itself writes no such key (gemma3, phi3, olmo2);
- a reference folder (config.json, model.safetensors) for transformers: the values the file
  holds, read back with transformers' conventions (quantized blocks dequantized with
  gguf.quants.dequantize, the Q/K permutation undone, 1 subtracted from Gemma's norms), under
  the config that the file means to llama.cpp. transformers on the reference is thus
  transformers on the file's values, independent of pagecli's GGUF reader.

Where the file cannot express the checkpoint's config, the reference config follows what
llama.cpp makes of the file:

- gemma3: the converter writes no layer pattern, so llama.cpp's default of 6 applies (layer i
  slides unless i % 6 == 5; a 4-layer model slides in every layer), and llama.cpp scales the
  queries by 1/sqrt(head_dim) (62 layers, the 27B: 1/sqrt(hidden / heads)), not by the
  checkpoint's query_pre_attn_scalar, for which there is no key;
- llama (Mistral): the converter writes no sliding window and llama.cpp's llama arch has none,
  so the reference has `sliding_window=None` (transformers reads such a file as a Llama).

Two choices follow transformers rather than llama.cpp's run time, as pagecli does: Phi-3's
`attention.sliding_window` is applied (llama.cpp switches SWA off for phi3), and its LongRoPE
factor set is picked per sequence length past the original context (llama.cpp picks it once
from the configured context size).

`fmt` picks the block format; a 2-D weight whose column count is not a multiple of the
format's block width stays F32. `expert_fmt` gives the expert stacks another (Q2_K: random
blocks, for the refusal of experts in a format pagecli does not keep). `extra_configs`
adds checkpoints the family configs lack: 6-layer Gemma 3 files with a global layer (one of
them readable by transformers' own GGUF
reader) and a Granite without attention biases.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from tests.gguf_models import _permute, quantize

# the families of tests/tiny_models.family_configs() -> the GGUF arch llama.cpp converts them
# to (Ministral's tiny checkpoint is left out: MinistralForCausalLM has no converter, and
# Ministral-8B-2410 is a MistralForCausalLM, i.e. the same llama file as mistral_window)
FAMILY_ARCHS = {
    "gemma3": "gemma3",
    "phi3": "phi3",
    "phi4": "phi3",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "granite": "granite",
    "mistral_window": "llama",
}
PERMUTED_ARCHS = {"llama", "smollm3", "granite"}  # LlamaModel subclasses (undo_permute)
NORM_PLUS_ONE_ARCHS = {"gemma3"}  # Gemma3Model.norm_shift
FILE_TYPES = {
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
    "q5_0": "MOSTLY_Q5_0",
    "q5_1": "MOSTLY_Q5_1",
    "q4_k": "MOSTLY_Q4_K_M",
    "q5_k": "MOSTLY_Q5_K_M",
    "q6_k": "MOSTLY_Q6_K",
    "bf16": "MOSTLY_BF16",
    "iq4_nl": "MOSTLY_IQ4_NL",
    "iq4_xs": "MOSTLY_IQ4_XS",
    "mxfp4": "MOSTLY_MXFP4_MOE",
}


def extra_configs() -> dict:
    """Checkpoints beside tests/tiny_models.family_configs() for the GGUF tests.

    Two 6-layer Gemma 3 (five sliding layers, then a global one: llama.cpp's default pattern,
    so the file needs no pattern key) with head_dim 256 = query_pre_attn_scalar, the real
    models' attention scale, which llama.cpp hardcodes. "gemma3_linear": the global layers'
    RoPE linearly scaled, the local base 20000 (keys transformers' GGUF reader ignores);
    "gemma3_plain": the defaults that reader assumes (no scaling, local base 10000), so
    transformers can read that file itself. "granite_nobias": Granite as the released
    Granite 3 models are, without attention biases."""
    from transformers import Gemma3TextConfig, GraniteConfig

    from tests.tiny_models import COMMON, WINDOW, family_configs

    common = {
        **COMMON,
        "num_hidden_layers": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "sliding_window": WINDOW,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    granite = family_configs()["granite"].to_dict()
    granite["attention_bias"] = False
    return {
        "gemma3_linear": Gemma3TextConfig(
            **common,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            },
        ),
        "gemma3_plain": Gemma3TextConfig(
            **common,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        "granite_nobias": GraniteConfig.from_dict(granite),
    }


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `_permute` (transformers' LlamaTensorProcessor)."""
    d2 = w.shape[0] // heads // 2
    return w.reshape(heads, d2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(hp: dict) -> dict:
    """The checkpoint's RoPE parameters (transformers 5 `rope_parameters`, else 4's
    `rope_scaling` with `rope_theta` beside it), as the converter's TextModel mirrors them."""
    rope = dict(hp.get("rope_parameters") or hp.get("rope_scaling") or {})
    if "full_attention" not in rope and "sliding_attention" not in rope:
        for key in ("rope_theta", "partial_rotary_factor", "original_max_position_embeddings"):
            if key not in rope and hp.get(key) is not None:
                rope[key] = hp[key]
    return rope


def _text_model_keys(writer, hp: dict, rope: dict, fmt: str) -> None:
    """TextModel.set_gguf_parameters (conversion/base.py) for the keys our configs have."""
    import gguf

    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    if hp.get("intermediate_size") is not None:  # a MoE-only model has none (find_hparam)
        writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    full = rope.get("full_attention", rope)
    rope_type = full.get("rope_type", "default")
    if rope_type == "linear" and full.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    elif rope_type == "yarn":  # GptOssModel: the type, factor and original context
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_orig_ctx_len(full.get("original_max_position_embeddings", 4096))
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r} in these tests")
    if full.get("rope_theta") is not None:
        writer.add_rope_freq_base(full["rope_theta"])
    local = rope.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        writer.add_rope_freq_base_swa(local)
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES.get(fmt, "ALL_F32")])


def _phi3_keys(writer, hp: dict, rope: dict, fmt: str) -> float | None:
    """Phi3MiniModel.set_gguf_parameters (conversion/phi.py; it does not call TextModel's):
    returns the LongRoPE attention factor it writes, if any (generate_extra_tensors)."""
    import gguf

    n_embd, n_head = hp["hidden_size"], hp["num_attention_heads"]
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES.get(fmt, "ALL_F32")])
    writer.add_sliding_window(hp.get("sliding_window") or 0)  # 0: Phi-4 (no window)
    if not rope.get("long_factor"):
        return None
    scale = hp["max_position_embeddings"] / rope["original_max_position_embeddings"]
    assert rope["rope_type"] in ("longrope", "su"), rope
    original = rope["original_max_position_embeddings"]
    factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    writer.add_rope_scaling_attn_factors(factor)
    assert len(rope["long_factor"]) == len(rope["short_factor"]) == rope_dims // 2
    return factor


def _qwen35_keys(writer, hp: dict, rope: dict, fmt: str) -> None:
    """Qwen3NextModel and Qwen3_5TextModel.set_gguf_parameters (conversion/qwen.py): the
    DeltaNet shape as ssm.* keys, the layer interval, the rotary width, mRoPE's sections."""
    _text_model_keys(writer, hp, rope, fmt)
    types = hp["layer_types"]
    interval = types.index("full_attention") + 1
    pattern = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(len(types))
    ]
    assert types == pattern, "a qwen35 file states only an interval"
    writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hp["linear_key_head_dim"])
    writer.add_ssm_group_count(hp["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(hp["head_dim"] * rope.get("partial_rotary_factor", 1)))
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_vocab_size(hp["vocab_size"])  # stands in for the tokenizer


def _tile_value_heads(values: np.ndarray, hp: dict, axis: int, width: int, inverse=False):
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head ->
    tiled (key head j mod Hk serves value head j), along `axis` in units of `width`;
    `inverse` undoes it."""
    nk, nv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    shape = list(values.shape)
    groups = (nv // nk, nk) if inverse else (nk, nv // nk)
    split = values.reshape(*shape[:axis], *groups, width, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(split, axis, axis + 1)).reshape(shape)


def _qwen35_stored(name: str, values: np.ndarray, hp: dict) -> np.ndarray:
    """The converter's modify_tensors for one float32 tensor of a Qwen3.5 checkpoint: value
    heads tiled where Hv != Hk, then A as -exp(A_log), the conv squeezed, norms (not the
    gated one) as 1 + w."""
    if hp["linear_num_key_heads"] != hp["linear_num_value_heads"] and "linear_attn." in name:
        values = _tile_v(name, values, hp, inverse=False)
    if name.endswith(".A_log"):
        return (-np.exp(values)).astype(np.float32)
    if name.endswith(".conv1d.weight"):
        return values.reshape(values.shape[0], -1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return values + np.float32(1.0)
    return values


def _qwen35_read(name: str, stored: np.ndarray, hp: dict) -> np.ndarray:
    """transformers' conventions from the stored values: A_log = log(-A) (its
    MambaTensorProcessor), the conv's channel axis, norms less 1, value heads grouped."""
    if name.endswith(".A_log"):
        stored = np.log(-stored)
    elif name.endswith(".conv1d.weight"):
        stored = stored.reshape(stored.shape[0], 1, -1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        stored = stored - np.float32(1.0)
    if hp["linear_num_key_heads"] != hp["linear_num_value_heads"] and "linear_attn." in name:
        stored = _tile_v(name, stored, hp, inverse=True)
    return stored


def _tile_v(name: str, values: np.ndarray, hp: dict, inverse: bool) -> np.ndarray:
    """The value-head reorder of each DeltaNet tensor (_LinearAttentionVReorderBase)."""
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]
    qk = 2 * hp["linear_num_key_heads"] * dk
    if ".in_proj_qkv." in name or ".conv1d." in name:
        v = _tile_value_heads(values[qk:], hp, 0, dv, inverse)
        return np.concatenate([values[:qk], v])
    if ".in_proj_z." in name:
        return _tile_value_heads(values, hp, 0, dv, inverse)
    if ".in_proj_a." in name or ".in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
        return _tile_value_heads(values, hp, 0, 1, inverse)
    if ".out_proj." in name:
        return _tile_value_heads(values, hp, 1, dv, inverse)
    return values


MOE_ARCHS = {"qwen3moe", "olmoe", "gpt-oss"}
QWEN35_ARCHS = {"qwen35", "qwen35moe"}
# an expert's tensor: transformers' names, or Mixtral's (block_sparse_moe, w1/w3/w2)
EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
EXPERT_KINDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
EXPERT_KINDS.update(w1="gate", w3="up", w2="down")


def _has_experts(hp: dict) -> bool:
    return bool(hp.get("num_experts") or hp.get("num_local_experts"))


def _moe_keys(writer, hp: dict, arch: str) -> None:
    """TextModel.set_gguf_parameters' expert counts (num_local_experts or num_experts,
    num_experts_per_tok), and each expert's width where the arch has a key for it
    (Qwen3MoeModel: qwen3moe)."""
    writer.add_expert_count(hp.get("num_experts") or hp["num_local_experts"])
    writer.add_expert_used_count(hp["num_experts_per_tok"])
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch == "gpt-oss":  # GptOssModel: each expert's width, the window
        writer.add_expert_feed_forward_length(hp["intermediate_size"])
        writer.add_sliding_window(hp["sliding_window"])


def _unstack_gpt_oss(state: dict) -> tuple[dict, dict]:
    """gpt-oss's stacked experts as GptOssModel.modify_tensors writes them: gate and up apart
    (the stack's alternate columns), each expert's rows [out, in] under per-expert names for
    _expert_stacks, the biases as blk.N.ffn_{gate,up,down}_exps.bias [E, rows] (F32)."""
    out, biases = {}, {}
    for name, tensor in state.items():
        stem, _, leaf = name.rpartition(".")
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if leaf == "gate_up_proj":  # [E, H, 2I]
            for e in range(tensor.shape[0]):
                w = tensor[e].t()
                out[f"{stem}.{e}.gate_proj.weight"] = w[0::2].contiguous()
                out[f"{stem}.{e}.up_proj.weight"] = w[1::2].contiguous()
        elif leaf == "down_proj" and ".experts." in name:  # [E, I, H]
            for e in range(tensor.shape[0]):
                out[f"{stem}.{e}.down_proj.weight"] = tensor[e].t().contiguous()
        elif leaf == "gate_up_proj_bias":
            biases[f"blk.{layer}.ffn_gate_exps.bias"] = tensor[:, 0::2]
            biases[f"blk.{layer}.ffn_up_exps.bias"] = tensor[:, 1::2]
        elif leaf == "down_proj_bias":
            biases[f"blk.{layer}.ffn_down_exps.bias"] = tensor
        else:
            out[name] = tensor
    return out, biases


def _restack_gpt_oss(reference: dict, hp: dict, biases: dict) -> None:
    """The reference's per-expert rows (as the file holds them) back in transformers'
    stacked gpt-oss layout, with the biases."""
    n = hp["num_local_experts"]
    for layer in range(hp["num_hidden_layers"]):
        stem = f"model.layers.{layer}.mlp.experts"

        def take(kind: str, stem: str = stem) -> torch.Tensor:
            return torch.stack([reference.pop(f"{stem}.{e}.{kind}.weight") for e in range(n)])

        gate, up = take("gate_proj"), take("up_proj")  # [E, I, H]
        reference[f"{stem}.gate_up_proj"] = (
            torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
        )
        reference[f"{stem}.down_proj"] = take("down_proj").transpose(1, 2).contiguous()
        g, u = (biases[f"blk.{layer}.ffn_{k}_exps.bias"] for k in ("gate", "up"))
        reference[f"{stem}.gate_up_proj_bias"] = torch.stack([g, u], 2).flatten(1)
        reference[f"{stem}.down_proj_bias"] = biases[f"blk.{layer}.ffn_down_exps.bias"]


def _random_q2_k(rows: int, cols: int) -> np.ndarray:
    """Random Q2_K super-blocks (scales[16], qs[64], then f16 d and dmin): gguf has no
    quantizer for it, and the files that hold it only test that pagecli refuses it."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 84), dtype=np.uint8)
    blocks[:, 80:84] = np.array([0.01, 0.001], np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


RANDOM_BLOCKS = {"q2_k": _random_q2_k}


def _expert_stacks(writer, state: dict, fmt: str, reference: dict) -> None:
    """The converter's 3-D expert tensors (Qwen2MoeModel.modify_tensors stacks each layer's
    experts): blk.N.ffn_{gate,up,down}_exps [E, rows, cols] in `fmt`, quantized row by row as
    llama-quantize does; the reference keeps each expert's dequantized rows."""
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    stacks: dict[tuple[int, str], dict[int, tuple[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        found = EXPERT.fullmatch(name)
        if found:
            layer, expert, kind = int(found[1]), int(found[2]), EXPERT_KINDS[found[3]]
            stacks.setdefault((layer, kind), {})[expert] = (name, tensor)
    for (layer, kind), experts in sorted(stacks.items()):
        values = torch.stack([experts[e][1] for e in range(len(experts))]).numpy()  # [E, r, c]
        count, rows, cols = values.shape
        if fmt in RANDOM_BLOCKS:  # a format pagecli refuses for experts: any valid blocks
            blocks = RANDOM_BLOCKS[fmt](count * rows, cols)
        else:
            blocks = quantize(values.reshape(count * rows, cols), fmt)  # [E r, row bytes]
        writer.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight",
                          blocks.reshape(count, rows, -1), raw_dtype=qtype)  # fmt: skip
        stored = gguf.quants.dequantize(blocks, qtype).reshape(count, rows, cols)
        for e in range(count):  # under the checkpoint's own names
            name = experts[e][0]
            reference[name] = torch.from_numpy(np.ascontiguousarray(stored[e], np.float32))


def _write_metadata(writer, arch: str, hp: dict, fmt: str) -> None:
    """The converter's metadata for `arch` from the checkpoint's config.json `hp`."""
    rope = _rope(hp)
    if arch in MOE_ARCHS:
        _text_model_keys(writer, hp, rope, fmt)
        _moe_keys(writer, hp, arch)
        writer.add_vocab_size(hp["vocab_size"])  # stands in for the tokenizer
        return
    if arch == "qwen35moe":  # Qwen3_5MoeTextModel: qwen35's keys and the experts'
        _qwen35_keys(writer, hp, rope, fmt)
        _moe_keys(writer, hp, "qwen3moe")  # with expert_feed_forward_length
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
        return
    if _has_experts(hp):  # Mixtral as a llama file (LlamaModel: TextModel's expert keys)
        _moe_keys(writer, hp, arch)
    if arch == "qwen35":
        _qwen35_keys(writer, hp, rope, fmt)
        return
    if arch == "phi3":
        _phi3_keys(writer, hp, rope, fmt)
        writer.add_vocab_size(hp["vocab_size"])  # stands in for the tokenizer
        return
    if arch == "granite":
        hp = {k: v for k, v in hp.items() if k != "head_dim"}  # GraniteModel pops it
    if arch == "gemma3":  # Gemma3Model's defaults where the config lacks the value
        hp = {**hp, "head_dim": hp.get("head_dim", 256)}
    _text_model_keys(writer, hp, rope, fmt)
    if arch in PERMUTED_ARCHS:  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(
            hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
        )
    else:
        writer.add_vocab_size(hp["vocab_size"])  # stands in for the tokenizer
    if arch == "gemma3" and hp.get("sliding_window_pattern") != 1:
        writer.add_sliding_window(hp["sliding_window"])
    if arch == "granite":  # GraniteModel: the multipliers, under llama.cpp's names
        for key, add in (
            ("attention_multiplier", writer.add_attention_scale),
            ("embedding_multiplier", writer.add_embedding_scale),
            ("residual_multiplier", writer.add_residual_scale),
            ("logits_scaling", writer.add_logit_scale),
        ):
            if hp.get(key):
                add(hp[key])


def _reference_config(config, arch: str):
    """The checkpoint's config as llama.cpp reads the file (module docstring)."""
    config = copy.deepcopy(config)
    if arch == "gemma3":
        layers = config.num_hidden_layers
        config.layer_types = [
            "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)
        ]
        if layers == 62:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = config.head_dim
    if arch == "llama":
        config.sliding_window = None
        if hasattr(config, "layer_types"):
            config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


def _block_width(fmt: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt.upper()]][0]


def write_family_gguf(
    model_dir: Path, out_dir: Path, arch: str, fmt: str = "q8_0", expert_fmt: str | None = None
) -> tuple[Path, Path]:
    """`model_dir` (a tiny safetensors checkpoint) as a GGUF file of llama.cpp architecture
    `arch` with its 2-D weights in `fmt`, and a reference folder for transformers holding the
    file's values (module docstring). Returns (gguf path, reference folder)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    hp = json.loads((model_dir / "config.json").read_text())
    config = AutoConfig.from_pretrained(str(model_dir))
    state = {k: v.float() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    heads, kv_heads = hp["num_attention_heads"], hp["num_key_value_heads"]
    model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(model_arch, hp["num_hidden_layers"])  # the converter's
    qtype = gguf.GGMLQuantizationType[fmt.upper()]

    path = out_dir / f"{model_dir.name}-{fmt}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, hp, fmt)
    reference: dict[str, torch.Tensor] = {}
    expert_biases = {}
    if arch == "gpt-oss":
        state, expert_biases = _unstack_gpt_oss(state)
        for name, bias in expert_biases.items():
            writer.add_tensor(name, np.ascontiguousarray(bias.numpy(), np.float32))
    if _has_experts(hp):
        _expert_stacks(writer, state, expert_fmt or fmt, reference)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and bool(hp.get("tie_word_embeddings")):
            continue  # the converter skips a tied head (Gemma 3 always)
        if EXPERT.fullmatch(hf_name):
            continue  # in the expert stacks
        converted = hf_name.replace(".dt_bias", ".dt_proj.bias")  # Qwen3NextModel's rename
        name = names.get_name(converted, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"{arch}: no GGUF name for {hf_name}"
        if name.endswith(".attn_sinks"):
            name += ".weight"  # GptOssModel.modify_tensors
        values = tensor.numpy().astype(np.float32)  # [out, in] or [n]
        if arch in QWEN35_ARCHS:
            values = _qwen35_stored(hf_name, values, hp)
        perm_heads = None
        if arch in PERMUTED_ARCHS and ".attn_q." in f".{name}":
            perm_heads = heads
        elif arch in PERMUTED_ARCHS and ".attn_k." in f".{name}":
            perm_heads = kv_heads
        if perm_heads is not None:
            values = _permute(values, perm_heads)
        plus_one = arch in NORM_PLUS_ONE_ARCHS and hf_name.endswith("norm.weight")
        if plus_one:
            values = values + np.float32(1.0)  # float32, as the float32 checkpoint converts
        quantized = "norm" not in name and "ffn_gate_inp" not in name  # llama-quantize's
        if values.ndim == 2 and quantized and values.shape[1] % _block_width(fmt) == 0:
            blocks = quantize(values, fmt)  # [rows, row_bytes]
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            stored = gguf.quants.dequantize(blocks, qtype).reshape(values.shape)
        else:
            writer.add_tensor(name, values)
            stored = values
        stored = np.asarray(stored, dtype=np.float32)
        # back to transformers' conventions, as its GGUF reader does
        if perm_heads is not None:
            stored = _unpermute(stored, perm_heads)
        if plus_one:
            stored = stored - np.float32(1.0)
        if arch in QWEN35_ARCHS:
            stored = _qwen35_read(hf_name, stored, hp)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
    if arch == "phi3":
        rope = _rope(hp)
        if rope.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
            for kind in ("long", "short"):
                factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)  # [rot / 2]
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref_config = _reference_config(config, arch)
    ref_dir = out_dir / f"{model_dir.name}-{fmt}-reference"
    if arch == "gpt-oss":
        _restack_gpt_oss(reference, hp, expert_biases)
    if _has_experts(hp):  # per-expert names: transformers' loader fuses them
        from safetensors.torch import save_file

        ref_config.save_pretrained(str(ref_dir))
        save_file(reference, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
        return path, ref_dir
    model = AutoModelForCausalLM.from_config(ref_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.save_pretrained(str(ref_dir))
    return path, ref_dir
