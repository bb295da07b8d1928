"""Gemma 3 (text: 270M, 1B; the text stack of 4B-27B as llama.cpp's GGUFs hold it).

Five sliding-window layers to one global (`layer_types`), each type with its own RoPE
parameters; per-head q/k RMSNorm; four norms per layer (sandwich), all (1 + w) RMSNorms;
embeddings scaled by sqrt(hidden); gelu-tanh gated MLP; attention scaled by
query_pre_attn_scalar; head_dim 256; tied embeddings over a 262k vocabulary.
"""

from __future__ import annotations

from pagecli.loader.gguf_config import get
from pagecli.models.base import GGUFArch
from pagecli.models.blocks import (
    AttentionSpec,
    DecoderModel,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    activation,
    check_window,
    head_dim,
    layer_windows,
    num_kv_heads,
)


def _fix_gguf_config(reader, arch: str, values: dict) -> None:
    """What transformers' GGUF map misses of Gemma 3 (llama.cpp's keys and conventions): the
    text model's type (as transformers' own GGUF reader renames it), the global layers' linear
    RoPE scaling (4B and larger), the local layers' RoPE base, and the query scale: llama.cpp
    scales by 1/sqrt(head_dim), the 62-layer 27B by 1/sqrt(hidden / heads) (168)."""
    values["model_type"] = "gemma3_text"
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": values.get("rope_theta", 1e6)},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    if get(reader, f"{arch}.rope.scaling.type") == "linear":
        factor = float(get(reader, f"{arch}.rope.scaling.factor", 1.0))
        rope["full_attention"].update(rope_type="linear", factor=factor)
    local_base = get(reader, f"{arch}.rope.freq_base_swa")
    if local_base is not None:
        rope["sliding_attention"]["rope_theta"] = float(local_base)
    values.pop("rope_theta", None)
    values["rope_parameters"] = rope
    heads = values["num_attention_heads"]
    if values.get("num_hidden_layers") == 62:
        values["query_pre_attn_scalar"] = values["hidden_size"] // heads
    else:
        values["query_pre_attn_scalar"] = values.get("head_dim") or values["hidden_size"] // heads


class Gemma3ForCausalLM(DecoderModel):
    """Gemma 3's text model."""

    hf_architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    gguf = (
        GGUFArch(
            "gemma3",
            "Gemma3ForCausalLM",
            layer_names={
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            norm_offset=True,
            fix_config=_fix_gguf_config,
        ),
    )

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                "attention logit soft-capping (attn_logit_softcapping) is not supported"
            )
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("bidirectional attention (an embedding model) is not supported")
        d = head_dim(config)
        mlp = MLPSpec(config.intermediate_size, activation(config, "hidden_activation"))
        layers = []
        for window, layer_type in zip(layer_windows(config), config.layer_types):
            attention = AttentionSpec(
                num_heads=config.num_attention_heads,
                num_kv_heads=num_kv_heads(config),
                head_dim=d,
                scale=config.query_pre_attn_scalar**-0.5,
                qkv_bias=bool(config.attention_bias),
                o_bias=bool(config.attention_bias),
                qk_norm="head",
                rope=layer_type,
                window=check_window(window),
            )
            layers.append(LayerSpec(attention, mlp, norms="sandwich"))
        return ModelSpec.of(
            config,
            layers,
            tied=True,
            norm_style="offset",
            embedding_multiplier=config.hidden_size**0.5,
            embedding_multiplier_rounded=True,
            logit_softcap=getattr(config, "final_logit_softcapping", None),
        )
