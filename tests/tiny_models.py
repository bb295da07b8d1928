"""Tiny random-weight checkpoints of every supported architecture, made with transformers'
config classes. Weights are drawn with a larger spread than usual so that logits are decisive
(a random model with tiny weights produces near-ties everywhere)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
)


def tiny_configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama3": LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        # head_dim 64, the smallest the Triton kernels take (tests/engine/test_triton_engine.py)
        "llama3_hd64": LlamaConfig(
            **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
            head_dim=64,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "mistral": MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": Qwen3Config(
            **{**COMMON, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True
        ),
    }


# The families of models/: windows shorter than the test prompts (which run to 300 tokens),
# each family's own variants (LongRoPE past 64 positions, NoPE layers, multipliers).
WINDOW = 24


def family_configs():
    from transformers import (
        Gemma3TextConfig,
        GraniteConfig,
        MinistralConfig,
        MistralConfig,
        Olmo2Config,
        Olmo3Config,
        Phi3Config,
        Qwen3_5TextConfig,
        SmolLM3Config,
    )

    common = {**COMMON, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    layers4 = {**common, "num_hidden_layers": 4}
    return {
        # 3 sliding layers to 1 global, each type its RoPE (the global one linearly scaled)
        "gemma3": Gemma3TextConfig(
            **{**layers4, "hidden_activation": "gelu_pytorch_tanh"},
            head_dim=32,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
        ),
        # partial rotary (a quarter of each head), LongRoPE past 64 positions, a window
        "phi3": Phi3Config(
            **common,
            original_max_position_embeddings=64,
            sliding_window=WINDOW,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "short_factor": [1.0, 1.1],
                "long_factor": [1.7, 3.1],
            },
            tie_word_embeddings=False,
        ),
        # Phi-4: full rotary, no window, 4 KV heads over 2 ranks
        "phi4": Phi3Config(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=False),
        "smollm3": SmolLM3Config(**layers4, tie_word_embeddings=True),  # layer 3: no RoPE
        "olmo2": Olmo2Config(**common, tie_word_embeddings=False),
        # OLMo 2's block, 3 sliding layers to 1 global, RoPE per layer type
        "olmo3": Olmo3Config(
            **layers4,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=False,
        ),
        "granite": GraniteConfig(
            **common,
            attention_bias=True,
            embedding_multiplier=12.0,
            attention_multiplier=0.2,
            residual_multiplier=0.22,
            logits_scaling=2.5,
            tie_word_embeddings=True,
        ),
        "mistral_window": MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False),
        # 3 Gated DeltaNet layers to 1 gated full-attention layer, 2 key heads to 4 value
        # heads, partial rotary (a quarter of each head)
        "qwen3_5": Qwen3_5TextConfig(
            **layers4,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            tie_word_embeddings=True,
        ),
        "ministral": MinistralConfig(
            **common,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
    }


def moe_configs():
    """The mixture-of-experts families: routers that pick different experts for different
    tokens (the checkpoints' spread makes the router logits decisive), a dense layer among the
    sparse ones (Qwen3-MoE's mlp_only_layers), a gated shared expert (Qwen2-MoE)."""
    from transformers import (
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3MoeConfig,
    )

    common = {**COMMON, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    return {
        "qwen3_moe": Qwen3MoeConfig(
            **{**common, "num_hidden_layers": 3},
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
        "qwen2_moe": Qwen2MoeConfig(
            **common,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        "mixtral": MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        ),
        "olmoe": OlmoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        # gpt-oss: sinks, a window of 128 on layers 0 and 2, YaRN as the released models
        # have it (factor 32 over 4096), biased router and experts, the clamped SwiGLU
        "gpt_oss": GptOssConfig(
            **common
            | {"num_hidden_layers": 3, "max_position_embeddings": 131072, "intermediate_size": 32},
            head_dim=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=False,
        ),
        # Qwen3.5's layers (3 Gated DeltaNet, 2 key heads to 4 value heads, to 1 gated
        # attention) with a MoE and a shared expert in each
        "qwen3_5_moe": Qwen3_5MoeTextConfig(
            **{k: v for k, v in common.items() if k != "intermediate_size"}
            | {"num_hidden_layers": 4},
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            tie_word_embeddings=True,
        ),
    }


def kv_memory(config, blocks: int, block_size: int, value_bytes: int = 4) -> float:
    """GiB of `blocks` blocks of K and V for every layer of a model (float32 values by
    default): a KV budget that means the same with and without window tables
    (--num-kv-blocks counts pages, and a hybrid model's pages hold fewer layers)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_block = 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * head_dim
    return blocks * per_block * value_bytes / 2**30


def moe_specs(width: int) -> dict:
    """One MoE layer of each router and activation the families use, experts `width` wide,
    for the kernel tests (hidden size 64)."""
    from pagecli.layers.moe import MoESpec

    return {
        # Qwen3-MoE: softmax over all, top 4 of 16, renormalized
        "softmax_topk": MoESpec(16, 4, width, norm_topk_prob=True),
        # Qwen2-MoE: not renormalized, a gated shared expert
        "shared": MoESpec(8, 2, width, shared_intermediate_size=width * 3 // 2),
        # gpt-oss: top k of the biased logits, softmaxed; biased experts, the clamped SwiGLU
        "gpt_oss": MoESpec(
            8,
            4,
            width,
            activation="swiglu_oai",
            routing="topk_softmax",
            router_bias=True,
            expert_bias=True,
        ),  # fmt: skip
    }


def wide_moe_model(root: Path, family: str) -> Path:
    """A checkpoint of `family` (moe_configs()) whose hidden size and experts' width are 256:
    rows of whole super-blocks, for the GGUF formats of 256 values (IQ4_XS, Q2_K)."""
    config = moe_configs()[family]
    config.hidden_size = config.intermediate_size = 256
    return build_tiny_models(root, {family: config})[family]


def build_tiny_models(root: Path, configs=None) -> dict[str, Path]:
    """Each config (tiny_configs() by default) as a random-weight safetensors folder."""
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, (name, config) in enumerate((configs or tiny_configs()).items()):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" not in param_name:
                    param.normal_(0.0, 0.08 if "embed" not in param_name else 1.0)
                elif configs is not None:  # the families: norms away from their init too
                    param.add_(torch.randn_like(param) * 0.2)
                if param_name.endswith("bias"):
                    param.normal_(0.0, 0.5)
                if param_name.endswith("sinks"):  # gpt-oss's: weights that matter
                    param.normal_(0.0, 2.0)
        path = root / name
        model.save_pretrained(str(path))
        paths[name] = path
    return paths
