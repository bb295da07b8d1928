"""Which architectures pagecli runs, and the class that runs each: one line per family."""

from __future__ import annotations

from pagecli.errors import UnsupportedModelError
from pagecli.models.base import CausalLM, GGUFArch
from pagecli.models.gemma3 import Gemma3ForCausalLM
from pagecli.models.gpt_oss import GptOssForCausalLM
from pagecli.models.granite import GraniteForCausalLM
from pagecli.models.llama import LlamaForCausalLM
from pagecli.models.mixtral import MixtralForCausalLM
from pagecli.models.olmo2 import Olmo2ForCausalLM
from pagecli.models.olmo3 import Olmo3ForCausalLM
from pagecli.models.olmoe import OlmoeForCausalLM
from pagecli.models.phi3 import Phi3ForCausalLM
from pagecli.models.qwen3_5 import Qwen3_5ForCausalLM
from pagecli.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from pagecli.models.qwen3_moe import Qwen3MoeForCausalLM
from pagecli.models.smollm3 import SmolLM3ForCausalLM

FAMILIES: tuple[type[CausalLM], ...] = (
    LlamaForCausalLM,
    Gemma3ForCausalLM,
    Phi3ForCausalLM,
    SmolLM3ForCausalLM,
    Olmo2ForCausalLM,
    GraniteForCausalLM,
    Olmo3ForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3MoeForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    GptOssForCausalLM,
)
ARCHITECTURES = {arch: cls for cls in FAMILIES for arch in cls.hf_architectures}
MODEL_TYPES = {model_type: cls for cls in FAMILIES for model_type in cls.model_types}
MULTIMODAL = {
    arch: (cls, prefix) for cls in FAMILIES for arch, prefix in cls.multimodal_architectures.items()
}
GGUF_ARCHS: dict[str, tuple[GGUFArch, type[CausalLM]]] = {
    arch.name: (arch, cls) for cls in FAMILIES for arch in cls.gguf
}


def model_class(config) -> type[CausalLM]:
    """The class that runs `config` (transformers' `architectures`, else its model type),
    after checking that it can run this config. UnsupportedModelError otherwise."""
    archs = getattr(config, "architectures", None) or []
    cls = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if cls is None and not archs:
        cls = MODEL_TYPES.get(getattr(config, "model_type", None))
    if cls is None:
        name = ", ".join(archs) or getattr(config, "model_type", "unknown")
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModelError(f"unsupported architecture {name} (supported: {supported})")
    try:
        cls.check_config(config)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None
    return cls


def checkpoint_class(architectures) -> type[CausalLM] | None:
    """The class that runs a checkpoint of these `architectures` (its own, or its language
    model's for a multimodal one), without checking its config; None when none does."""
    for arch in architectures or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
        if arch in MULTIMODAL:
            return MULTIMODAL[arch][0]
    return None


def multimodal_text_model(architectures) -> tuple[type[CausalLM], str] | None:
    """(the class that runs its language model, that model's tensor-name prefix) for a
    multimodal checkpoint's `architectures`, or None."""
    return next((MULTIMODAL[a] for a in architectures or () if a in MULTIMODAL), None)


def gguf_arch(name: str | None) -> GGUFArch | None:
    """How the GGUF architecture `name` is read, or None where pagecli has no family for it."""
    found = GGUF_ARCHS.get(name)
    return None if found is None else found[0]


def supported_gguf_archs() -> list[str]:
    return sorted(GGUF_ARCHS)
