"""OLMo 2: norms after each sublayer only (post-norm: h += norm(attn(h)), h += norm(mlp(h))),
q/k RMSNorm over the whole projection before the heads, and the norm weight applied before
rounding (transformers' Olmo2RMSNorm)."""

from __future__ import annotations

import dataclasses

from pagecli.loader.gguf_config import common_values
from pagecli.models.base import GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec
from pagecli.models.llama import llama_layers


def _gguf_config(reader, arch: str) -> dict:
    """OLMo 2's config from llama.cpp's keys (transformers cannot read this arch's GGUF)."""
    return common_values(reader, arch, "olmo2")


class Olmo2ForCausalLM(DecoderModel):
    """OLMo 2 (1B-32B)."""

    hf_architectures = ("Olmo2ForCausalLM",)
    model_types = ("olmo2",)
    gguf = (
        GGUFArch(
            "olmo2",
            "Olmo2ForCausalLM",
            layer_names={
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            config=_gguf_config,
        ),
    )

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        layers = tuple(
            dataclasses.replace(
                layer,
                attention=dataclasses.replace(layer.attention, qk_norm="full"),
                norms="post",
            )
            for layer in llama_layers(config)
        )
        return ModelSpec.of(
            config,
            layers,
            norm_style="float",
        )
