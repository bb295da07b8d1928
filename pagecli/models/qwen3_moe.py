"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B: per-head q/k norm, the top 8 of 128 experts
renormalized) and Qwen2-MoE (q/k/v bias, a gated shared expert beside the routed ones):
Llama's block with a sparse MoE MLP (layers/moe.py) where `mlp_only_layers` and
`decoder_sparse_step` put one. From safetensors (per-expert tensors) and from GGUF files
(`qwen3moe`), whose 3-D expert tensors are read as each expert's rows of the file's blocks.
"""

from __future__ import annotations

import dataclasses

from pagecli.loader.gguf_config import common_values, get, require
from pagecli.models.base import GGUF_EXPERT_NAMES, GGUF_ROUTER_NAMES, GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec, moe_spec, with_experts
from pagecli.models.llama import llama_layers


def gguf_moe_values(reader, arch: str, model_type: str) -> dict:
    """A MoE config from llama.cpp's keys: expert_count, expert_used_count and
    expert_feed_forward_length (each expert's width, where the arch writes one)."""
    values = common_values(reader, arch, model_type)
    values["num_experts"] = int(require(reader, f"{arch}.expert_count"))
    values["num_experts_per_tok"] = int(require(reader, f"{arch}.expert_used_count"))
    expert_ffn = get(reader, f"{arch}.expert_feed_forward_length")
    if expert_ffn is not None:
        values["moe_intermediate_size"] = int(expert_ffn)
    return values


def _gguf_config(reader, arch: str) -> dict:
    values = gguf_moe_values(reader, arch, "qwen3_moe")
    values["norm_topk_prob"] = True  # llama.cpp's qwen3moe graph renormalizes the top k
    return values


class Qwen3MoeForCausalLM(DecoderModel):
    """Qwen3-MoE and Qwen2-MoE."""

    hf_architectures = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
    model_types = ("qwen3_moe", "qwen2_moe")
    gguf = (
        GGUFArch(
            "qwen3moe",
            "Qwen3MoeForCausalLM",
            layer_names=GGUF_ROUTER_NAMES,
            expert_names=GGUF_EXPERT_NAMES,
            config=_gguf_config,
        ),
    )

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        qwen2 = config.model_type == "qwen2_moe"
        layers = llama_layers(config, qk_norm=not qwen2)
        if qwen2 and getattr(config, "qkv_bias", True):
            layers = tuple(
                dataclasses.replace(
                    layer, attention=dataclasses.replace(layer.attention, qkv_bias=True)
                )
                for layer in layers
            )
        moe = moe_spec(config, bool(config.norm_topk_prob))
        if not qwen2:
            moe = dataclasses.replace(moe, shared_intermediate_size=None)
        return ModelSpec.of(
            config,
            with_experts(config, layers, moe),
        )
