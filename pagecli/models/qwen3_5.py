"""Qwen3.5 / 3.6 dense (0.8B-27B; the text model).

Three layers of every four are Gated DeltaNet linear attention (layers/gated_delta.py: a
conv window and a recurrent state per sequence, no KV cache); the fourth is gated full
attention: q_proj gives each head's query and an output gate, q/k norms per head, partial
rotary (a quarter of each head; the text-only mRoPE, whose three position rows are equal, is
plain RoPE), the output times sigmoid(gate). All norms are (1 + w) RMSNorms, except the
DeltaNet's gated norm (w, then silu(z)). Safetensors of the text model
(`Qwen3_5ForCausalLM`); neither the multimodal checkpoints nor GGUF files (arch `qwen35`) are
read.
"""

from __future__ import annotations

from pagecli.layers.gated_delta import DeltaNetSpec
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


class Qwen3_5ForCausalLM(DecoderModel):
    """Qwen3.5's text model."""

    hf_architectures = ("Qwen3_5ForCausalLM",)
    model_types = ("qwen3_5_text",)
    packed_modules = {
        **DecoderModel.packed_modules,
        "in_proj": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    }

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
        )
        if linear.num_v_heads % linear.num_k_heads or linear.conv_kernel < 2:
            raise ValueError(
                f"{linear.num_v_heads} DeltaNet value heads over {linear.num_k_heads} key "
                f"heads, conv kernel {linear.conv_kernel}"
            )
        mlp = MLPSpec(config.intermediate_size, activation(config))
        layers = tuple(
            LayerSpec(attention, mlp)
            if kind == "full_attention"
            else LayerSpec(None, mlp, linear=linear)
            for kind in types
        )
        return ModelSpec(
            layers=layers,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            rms_norm_eps=config.rms_norm_eps,
            norm_style="offset",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )
