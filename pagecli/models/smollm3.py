"""SmolLM3: the Llama block without rotary positions in every fourth layer (NoPE)."""

from __future__ import annotations

from pagecli.loader.gguf_config import common_values
from pagecli.models.base import GGUFArch
from pagecli.models.blocks import DecoderModel, ModelSpec
from pagecli.models.llama import llama_layers


def _gguf_config(reader, arch: str) -> dict:
    """SmolLM3's config from llama.cpp's keys (transformers cannot read this arch's GGUF);
    llama.cpp has no key for the NoPE layers: every fourth, SmolLM3Config's default."""
    return common_values(reader, arch, "smollm3")


class SmolLM3ForCausalLM(DecoderModel):
    """SmolLM3 (3B)."""

    hf_architectures = ("SmolLM3ForCausalLM",)
    model_types = ("smollm3",)
    gguf = (GGUFArch("smollm3", "SmolLM3ForCausalLM", qk_permuted=True, config=_gguf_config),)

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        flags = getattr(config, "no_rope_layers", None)
        if flags is None or len(flags) != config.num_hidden_layers:
            raise ValueError("SmolLM3 needs no_rope_layers: one flag per layer (1: rotary)")
        return ModelSpec.of(
            config,
            llama_layers(config, nope=[not use_rope for use_rope in flags]),
            tied=True,
        )
