"""Qwen3.5 / 3.6 dense (0.8B-27B; the text model).

Three layers of every four are Gated DeltaNet linear attention (layers/gated_delta.py: a
conv window and a recurrent state per sequence, no KV cache); the fourth is gated full
attention: q_proj gives each head's query and an output gate, q/k norms per head, partial
rotary (a quarter of each head; the text-only mRoPE, whose three position rows are equal, is
plain RoPE), the output times sigmoid(gate). All norms are (1 + w) RMSNorms, except the
DeltaNet's gated norm (w, then silu(z)).

Read from safetensors of the text model (`Qwen3_5ForCausalLM`) or of the released multimodal
checkpoints (`Qwen3_5ForConditionalGeneration`: the language model under
`model.language_model.`, its config the `text_config`; the vision tower and the MTP head are
not read), and from GGUF files of arch `qwen35` as llama.cpp's converter writes them: norms
stored as 1 + w (not the gated one), A as -exp(A_log), the conv kernel squeezed to
[channels, kernel], and, where a key head serves several value heads, the value heads in
tiled order (value head j reads key head j mod Hk, not j // (Hv / Hk)): the rows of
in_proj's v/z/b/a parts, A, dt_bias, the conv's v channels and out_proj's columns all follow
that order, so the model keeps it (`DeltaNetSpec.v_heads_tiled`) and reads the quantized
blocks as they are. The multi-token-prediction layers a converter appends are not read.
"""

from __future__ import annotations

import numpy as np
import torch

from pagecli.layers.gated_delta import DeltaNetSpec
from pagecli.layers.moe import MoESpec
from pagecli.loader.gguf_config import common_values, get, require
from pagecli.models.base import GGUFArch
from pagecli.models.blocks import (
    AttentionSpec,
    DecoderModel,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    activation,
    head_dim,
    num_kv_heads,
)

KNOWN_LAYERS = {"linear_attention", "full_attention"}
TILED_KEY = "linear_value_heads_tiled"  # config value: the file keeps llama.cpp's tiled order


def _gguf_config(reader, arch: str) -> dict:
    """The text config from llama.cpp's `qwen35` keys (conversion/qwen.py, Qwen3NextModel and
    Qwen3_5TextModel): the DeltaNet shape from the ssm.* keys, the layer pattern from
    full_attention_interval (layer i is full attention when (i + 1) % interval == 0), the
    partial rotary from rope.dimension_count over the head size."""
    experts = get(reader, f"{arch}.expert_count")  # qwen35moe: no dense MLP width
    values = common_values(reader, arch, "qwen3_5_text", ffn=not experts)
    values["num_hidden_layers"] -= int(get(reader, f"{arch}.nextn_predict_layers", 0))
    head = values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
    k_heads = int(require(reader, f"{arch}.ssm.group_count"))
    v_heads = int(require(reader, f"{arch}.ssm.time_step_rank"))
    inner = int(require(reader, f"{arch}.ssm.inner_size"))
    if v_heads <= 0 or inner % v_heads:
        raise ValueError(f"{arch}.ssm.inner_size {inner} is not a multiple of {v_heads} heads")
    interval = int(get(reader, f"{arch}.full_attention_interval", 4))
    if interval <= 0:
        raise ValueError(f"{arch}.full_attention_interval is {interval}")
    rotary = int(get(reader, f"{arch}.rope.dimension_count", head // 4))
    values.update(
        linear_conv_kernel_dim=int(require(reader, f"{arch}.ssm.conv_kernel")),
        linear_key_head_dim=int(require(reader, f"{arch}.ssm.state_size")),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(values["num_hidden_layers"])
        ],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": values.pop("rope_theta"),
            "partial_rotary_factor": rotary / head,
        },
        attention_bias=False,
    )
    values[TILED_KEY] = v_heads != k_heads
    return values


def _gguf_convert(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The converter's stored conventions back to transformers', as its GGUF reader undoes
    them: A_log = log(-A) (in float32 numpy, MambaTensorProcessor), the conv kernel's
    channel axis back, norms (all but the gated one) stored as 1 + w back to w."""
    if name.endswith(".A_log"):
        return torch.from_numpy(np.log(-weight.numpy()))
    if name.endswith(".conv1d.weight"):
        return weight.reshape(weight.shape[0], 1, -1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return weight - 1
    return weight


def _untile_value_heads(tensors: dict[str, torch.Tensor], values: dict) -> None:
    """The DeltaNet tensors' value heads from llama.cpp's tiled order back to transformers'
    grouped one (value head j of key head j // r, r = Hv / Hk): rows of in_proj's v (after
    q and k), z, b and a parts, of the conv's v channels, A_log and dt_bias; out_proj's
    columns."""
    nk, nv = values["linear_num_key_heads"], values["linear_num_value_heads"]
    if not values.get(TILED_KEY) or nk == nv:
        return
    dv, qk = values["linear_value_head_dim"], 2 * nk * values["linear_key_head_dim"]

    def grouped(t: torch.Tensor, axis: int, width: int) -> torch.Tensor:
        shape = list(t.shape)
        split = t.reshape(*shape[:axis], nv // nk, nk, width, *shape[axis + 1 :])
        return split.transpose(axis, axis + 1).reshape(shape).contiguous()

    for name, t in tensors.items():
        if ".linear_attn." not in name:
            continue
        if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
            tensors[name] = torch.cat([t[:qk], grouped(t[qk:], 0, dv)])
        elif name.endswith(".in_proj_z.weight"):
            tensors[name] = grouped(t, 0, dv)
        elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
            tensors[name] = grouped(t, 0, 1)
        elif name.endswith(".out_proj.weight"):
            tensors[name] = grouped(t, 1, dv)


GGUF_QWEN35 = GGUFArch(
    "qwen35",
    "Qwen3_5ForCausalLM",
    layer_names={
        "post_attention_norm": "post_attention_layernorm",
        "attn_qkv": "linear_attn.in_proj_qkv",
        "attn_gate": "linear_attn.in_proj_z",
        "ssm_beta": "linear_attn.in_proj_b",
        "ssm_alpha": "linear_attn.in_proj_a",
        "ssm_conv1d": "linear_attn.conv1d",
        "ssm_norm": "linear_attn.norm",
        "ssm_out": "linear_attn.out_proj",
    },
    layer_tensors={"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
    convert=_gguf_convert,
    to_transformers=_untile_value_heads,
    config=_gguf_config,
)


class Qwen3_5ForCausalLM(DecoderModel):
    """Qwen3.5's text model."""

    hf_architectures = ("Qwen3_5ForCausalLM",)
    model_types = ("qwen3_5_text",)
    gguf = (GGUF_QWEN35,)
    multimodal_architectures = {"Qwen3_5ForConditionalGeneration": "model.language_model."}
    packed_modules = {
        **DecoderModel.packed_modules,
        "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    }

    @classmethod
    def mlp_spec(cls, config) -> MLPSpec | MoESpec:
        """Every layer's MLP: a dense gated MLP (the MoE variant: a sparse one)."""
        return MLPSpec(config.intermediate_size, activation(config))

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        types = list(config.layer_types)
        unknown = sorted(set(types) - KNOWN_LAYERS)
        if unknown:
            raise ValueError(f"unsupported layer type {unknown[0]!r}")
        num_layers = config.num_hidden_layers
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers for {num_layers}")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Qwen3.5 with RoPE type {rope['rope_type']!r} is not supported")
        d = head_dim(config)
        attention = AttentionSpec(
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv_heads(config),
            head_dim=d,
            scale=d**-0.5,
            qkv_bias=bool(config.attention_bias),
            o_bias=bool(config.attention_bias),
            qk_norm="head",
            output_gate=True,
        )
        linear = DeltaNetSpec(
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            k_head_dim=config.linear_key_head_dim,
            v_head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            eps=config.rms_norm_eps,
            v_heads_tiled=bool(getattr(config, TILED_KEY, False)),
        )
        if linear.num_v_heads % linear.num_k_heads or linear.conv_kernel < 2:
            raise ValueError(
                f"{linear.num_v_heads} DeltaNet value heads over {linear.num_k_heads} key "
                f"heads, conv kernel {linear.conv_kernel}"
            )
        mlp = cls.mlp_spec(config)
        layers = tuple(
            LayerSpec(attention, mlp)
            if kind == "full_attention"
            else LayerSpec(None, mlp, linear=linear)
            for kind in types
        )
        return ModelSpec.of(
            config,
            layers,
            norm_style="offset",
        )
