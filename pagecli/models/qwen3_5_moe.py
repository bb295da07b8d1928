"""Qwen3.5/3.6 MoE (Qwen3.5-35B-A3B and 122B-A10B, Qwen3.6-35B-A3B): Qwen3.5's layers (3
Gated DeltaNet to 1 gated attention; models/qwen3_5.py) with a sparse MoE MLP in every layer:
the top k of the experts, renormalized, beside a shared expert under a sigmoid gate
(layers/moe.py). From safetensors (the text model, or the released multimodal checkpoints'
language model) and from GGUF files (`qwen35moe`: Qwen3.5's stored conventions, the 3-D
expert stacks read as each expert's rows of the map, the shared expert's tensors).
"""

from __future__ import annotations

import dataclasses

from pagecli.layers.moe import MoESpec
from pagecli.loader.gguf_config import get, require
from pagecli.models.base import GGUF_EXPERT_NAMES, GGUF_ROUTER_NAMES
from pagecli.models.blocks import moe_spec
from pagecli.models.qwen3_5 import GGUF_QWEN35, Qwen3_5ForCausalLM
from pagecli.models.qwen3_5 import _gguf_config as _qwen35_config


def _gguf_config(reader, arch: str) -> dict:
    """Qwen3.5's config (qwen3_5.py) and the experts': llama.cpp's expert_count,
    expert_used_count, expert_feed_forward_length and expert_shared_feed_forward_length."""
    values = _qwen35_config(reader, arch)
    values["model_type"] = "qwen3_5_moe_text"
    values["num_experts"] = int(require(reader, f"{arch}.expert_count"))
    values["num_experts_per_tok"] = int(require(reader, f"{arch}.expert_used_count"))
    values["moe_intermediate_size"] = int(require(reader, f"{arch}.expert_feed_forward_length"))
    shared = get(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        values["shared_expert_intermediate_size"] = int(shared)
    return values


GGUF_QWEN35MOE = dataclasses.replace(
    GGUF_QWEN35,
    name="qwen35moe",
    hf_architecture="Qwen3_5MoeForCausalLM",
    layer_names={
        **GGUF_QWEN35.layer_names,
        **GGUF_ROUTER_NAMES,
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    },
    expert_names=GGUF_EXPERT_NAMES,
    config=_gguf_config,
)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's MoE text model."""

    hf_architectures = ("Qwen3_5MoeForCausalLM",)
    model_types = ("qwen3_5_moe_text",)
    gguf = (GGUF_QWEN35MOE,)
    multimodal_architectures = {"Qwen3_5MoeForConditionalGeneration": "model.language_model."}

    @classmethod
    def mlp_spec(cls, config) -> MoESpec:
        return moe_spec(config, norm_topk_prob=True)  # transformers' router renormalizes
