"""Which architectures pagecli runs, and the class that runs each."""

from __future__ import annotations

from pagecli.models.llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one pagecli implements."""


def model_class(config) -> type[LlamaForCausalLM]:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and getattr(config, "model_type", None) in MODEL_TYPES:
        return LlamaForCausalLM
    name = ", ".join(archs) or getattr(config, "model_type", "unknown")
    supported = ", ".join(sorted(ARCHITECTURES))
    raise UnsupportedModelError(f"unsupported architecture {name} (supported: {supported})")
