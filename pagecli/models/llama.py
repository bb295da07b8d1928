"""The Llama family: Llama 2/3 (llama3 RoPE scaling), Mistral and Ministral (their sliding
windows), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), SmolLM2; GQA/MQA and tied
embeddings. Pre-norm blocks of RMSNorm, RoPE attention and a SiLU-gated MLP."""

from __future__ import annotations

from pagecli.loader.gguf_config import get, require
from pagecli.models.base import GGUF_EXPERT_NAMES, GGUF_ROUTER_NAMES, GGUFArch
from pagecli.models.blocks import (
    AttentionSpec,
    DecoderModel,
    LayerSpec,
    MLPSpec,
    ModelSpec,
    activation,
    check_window,
    head_dim,
    layer_windows,
    num_kv_heads,
)


def _fix_llama_config(reader, arch: str, values: dict) -> None:
    """A `llama` file with experts is Mixtral (llama.cpp converts Mixtral to its llama arch):
    its expert counts, and the architecture that runs it."""
    experts = get(reader, f"{arch}.expert_count")
    if experts:
        values["model_type"] = "mixtral"
        values["num_local_experts"] = int(experts)
        values["num_experts_per_tok"] = int(require(reader, f"{arch}.expert_used_count"))
        values["architectures"] = ["MixtralForCausalLM"]


def llama_layers(config, *, qk_norm: bool = False, nope: list[bool] | None = None):
    """The Llama block of every layer of `config` (transformers' attributes): its window
    from `layer_types`/`sliding_window`; `nope[i]`: layer i has no rotary (SmolLM3)."""
    model_type = getattr(config, "model_type", "llama")
    attention_bias = bool(getattr(config, "attention_bias", False))
    d = head_dim(config)
    mlp = MLPSpec(
        config.intermediate_size, activation(config), bool(getattr(config, "mlp_bias", False))
    )
    layers = []
    for i, window in enumerate(layer_windows(config)):
        attention = AttentionSpec(
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv_heads(config),
            head_dim=d,
            scale=d**-0.5,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            qk_norm="head" if qk_norm else None,
            rope=None if nope is not None and nope[i] else "default",
            window=check_window(window),
        )
        layers.append(LayerSpec(attention, mlp))
    return tuple(layers)


class LlamaForCausalLM(DecoderModel):
    """Llama, Mistral, Ministral, Qwen2, Qwen3 and their GGUF files."""

    hf_architectures = (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "MinistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )
    model_types = ("llama", "mistral", "ministral", "qwen2", "qwen3")
    gguf = (
        # llama.cpp's converter interleaves the Q/K rows of its NORM-rope archs
        GGUFArch(
            "llama",
            "LlamaForCausalLM",
            qk_permuted=True,
            layer_names=GGUF_ROUTER_NAMES,  # Mixtral's, in a llama file with experts
            expert_names=GGUF_EXPERT_NAMES,
            fix_config=_fix_llama_config,
        ),
        GGUFArch("mistral", "MistralForCausalLM"),
        GGUFArch("qwen2", "Qwen2ForCausalLM"),
        GGUFArch("qwen3", "Qwen3ForCausalLM"),
    )

    @classmethod
    def model_spec(cls, config) -> ModelSpec:
        return ModelSpec.of(
            config,
            llama_layers(config, qk_norm=config.model_type == "qwen3"),
        )
