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


def build_tiny_models(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    paths = {}
    for i, (name, config) in enumerate(tiny_configs().items()):
        torch.manual_seed(1000 + i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" not in param_name:
                    param.normal_(0.0, 0.08 if "embed" not in param_name else 1.0)
                if param_name.endswith("bias"):
                    param.normal_(0.0, 0.5)
        path = root / name
        model.save_pretrained(str(path))
        paths[name] = path
    return paths
