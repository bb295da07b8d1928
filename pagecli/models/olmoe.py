"""OLMoE (1B-7B): Llama's pre-norm block with q/k norm over the whole projection and a MoE
in every layer (top 8 of 64, not renormalized; layers/moe.py). From safetensors and from
GGUF files (`olmoe`), whose 3-D expert tensors are read as each expert's rows of the file's
blocks.
"""

from __future__ import annotations

import dataclasses

from pagecli.models.base import GGUF_EXPERT_NAMES, GGUF_ROUTER_NAMES, GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec, moe_spec
from pagecli.models.llama import llama_layers
from pagecli.models.qwen3_moe import gguf_moe_values


def _gguf_config(reader, arch: str) -> dict:
    values = gguf_moe_values(reader, arch, "olmoe")
    values["norm_topk_prob"] = False  # llama.cpp's olmoe graph does not renormalize
    return values


class OlmoeForCausalLM(DecoderModel):
    """OLMoE."""

    hf_architectures = ("OlmoeForCausalLM",)
    model_types = ("olmoe",)
    gguf = (
        GGUFArch(
            "olmoe",
            "OlmoeForCausalLM",
            layer_names=GGUF_ROUTER_NAMES,
            expert_names=GGUF_EXPERT_NAMES,
            config=_gguf_config,
        ),
    )

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError("OLMoE with clip_qkv is not supported")
        layers = tuple(
            dataclasses.replace(
                layer, attention=dataclasses.replace(layer.attention, qk_norm="full")
            )
            for layer in llama_layers(config)
        )
        moe = moe_spec(config, bool(config.norm_topk_prob))
        return ModelSpec.of(
            config,
            tuple(dataclasses.replace(layer, mlp=moe) for layer in layers),
        )
