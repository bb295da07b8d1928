"""Granite 3: the Llama block with IBM's four multipliers: embeddings times
embedding_multiplier, attention scaled by attention_multiplier (not 1/sqrt(head_dim)), each
branch times residual_multiplier before it joins the residual, logits divided by
logits_scaling."""

from __future__ import annotations

import dataclasses

from pagecli.loader.gguf_config import common_values, require
from pagecli.models.base import GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec
from pagecli.models.llama import llama_layers


def _gguf_config(reader, arch: str) -> dict:
    """Granite's config from llama.cpp's keys (transformers cannot read this arch's GGUF)."""
    values = common_values(reader, arch, "granite")
    values["attention_multiplier"] = float(require(reader, f"{arch}.attention.scale"))
    values["embedding_multiplier"] = float(require(reader, f"{arch}.embedding_scale"))
    values["residual_multiplier"] = float(require(reader, f"{arch}.residual_scale"))
    values["logits_scaling"] = float(require(reader, f"{arch}.logit_scale"))
    # llama.cpp's granite takes biases where the file has them (optional tensors)
    names = {t.name for t in reader.tensors}
    values["attention_bias"] = "blk.0.attn_q.bias" in names
    values["mlp_bias"] = "blk.0.ffn_up.bias" in names
    return values


class GraniteForCausalLM(DecoderModel):
    """Granite 3.x dense models."""

    hf_architectures = ("GraniteForCausalLM",)
    model_types = ("granite",)
    gguf = (GGUFArch("granite", "GraniteForCausalLM", qk_permuted=True, config=_gguf_config),)

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        layers = tuple(
            dataclasses.replace(
                layer,
                attention=dataclasses.replace(layer.attention, scale=config.attention_multiplier),
                residual_multiplier=config.residual_multiplier,
            )
            for layer in llama_layers(config)
        )
        return ModelSpec.of(
            config,
            layers,
            embedding_multiplier=config.embedding_multiplier,
            logits_divisor=config.logits_scaling,
        )
