"""A GGUF file's metadata as transformers config values, for the families' own maps.

transformers reads the config of some GGUF architectures (llama, qwen2/3, gemma3, phi3) and
not others (smollm3, olmo2, granite). For those, a family's `GGUFArch.config` builds the
values from llama.cpp's keys with `common_values` plus its own, and loader/gguf_convert.py
turns them into transformers' config object; where transformers' map misses a key a family
needs (Gemma 3's rope scaling, Phi-3's partial rotary and LongRoPE factors), its
`GGUFArch.fix_config` adds it. Keys follow llama.cpp's gguf-py constants.
"""

from __future__ import annotations

from typing import Any


def get(reader, key: str, default: Any = None) -> Any:
    """A metadata value as a plain Python value (one-element arrays as their element)."""
    value = reader.get(key, default)
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value


def require(reader, key: str) -> Any:
    """A metadata value the file must have; ValueError naming the key otherwise."""
    value = get(reader, key)
    if value is None:
        raise ValueError(f"the GGUF file lacks {key}")
    return value


def common_values(reader, arch: str, model_type: str, ffn: bool = True) -> dict[str, Any]:
    """The config values every decoder shares, from `{arch}.*` and the tokenizer's ids
    (`ffn` False: a model whose every MLP is a mixture of experts, whose file may give no
    dense width)."""
    heads = int(require(reader, f"{arch}.attention.head_count"))
    values: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": int(require(reader, f"{arch}.embedding_length")),
        "num_hidden_layers": int(require(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(reader, f"{arch}.attention.head_count_kv", heads)),
        "max_position_embeddings": int(get(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
    }
    width = get(reader, f"{arch}.feed_forward_length")
    if ffn or width is not None:
        values["intermediate_size"] = int(width if width is not None else require(
            reader, f"{arch}.feed_forward_length"))  # fmt: skip
    head_dim = get(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        values["head_dim"] = int(head_dim)
    vocab = get(reader, f"{arch}.vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader:
        vocab = len(reader.get("tokenizer.ggml.tokens"))
    if vocab is None:
        raise ValueError(f"the GGUF file lacks {arch}.vocab_size and a tokenizer")
    values["vocab_size"] = int(vocab)
    for name in ("bos", "eos", "pad"):
        token = get(reader, f"tokenizer.ggml.{name}_token_id")
        if token is not None:
            values[f"{name}_token_id"] = int(token)
    return values


def tensor_values(reader, name: str) -> list[float] | None:
    """A small float tensor of the file (rope factors) as a list, or None if absent."""
    import numpy as np

    for t in reader.tensors:
        if t.name == name:
            return np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()
    return None
