"""Mixtral (8x7B, 8x22B): Mistral's block with a top-2 MoE in every layer, each token's two
routing weights renormalized (layers/moe.py). Its checkpoints name the MoE
`block_sparse_moe` and each expert's projections w1 (gate), w3 (up), w2 (down): read under
the shared names. Its GGUF files are `llama` files with experts (llama.py maps their config
here).
"""

from __future__ import annotations

import dataclasses

from pagecli.models.blocks import DecoderModel, ModelSpec, moe_spec
from pagecli.models.llama import llama_layers

EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(DecoderModel):
    """Mixtral."""

    hf_architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    gguf_shared = ("llama",)  # llama.cpp writes Mixtral as a llama file with experts

    @classmethod
    def rename_tensor(cls, name: str) -> str:
        """block_sparse_moe -> mlp, w1/w3/w2 -> gate_proj/up_proj/down_proj."""
        if ".block_sparse_moe." not in name:
            return name
        name = name.replace(".block_sparse_moe.", ".mlp.")
        stem, _, leaf = name.rpartition(".")
        owner, _, child = stem.rpartition(".")
        return f"{owner}.{EXPERT_NAMES.get(child, child)}.{leaf}"

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        moe = moe_spec(config, norm_topk_prob=True)
        return ModelSpec.of(
            config,
            tuple(dataclasses.replace(layer, mlp=moe) for layer in llama_layers(config)),
        )
