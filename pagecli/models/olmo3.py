"""OLMo 3: OLMo 2's block (post-norms, full-width q/k norm) with three sliding-window layers
to one global (`layer_types`), each type with its own RoPE parameters. Safetensors only:
llama.cpp writes OLMo 3 files under the `olmo2` architecture, which OLMo 2's family reads."""

from __future__ import annotations

import dataclasses

from pagecli.models.blocks import ModelSpec
from pagecli.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 (7B, 32B)."""

    hf_architectures = ("Olmo3ForCausalLM",)
    model_types = ("olmo3",)
    gguf = ()

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        spec = super().model_spec(config)
        layers = tuple(
            dataclasses.replace(layer, attention=dataclasses.replace(layer.attention, rope=kind))
            for layer, kind in zip(spec.layers, config.layer_types)
        )
        return dataclasses.replace(spec, layers=layers)
