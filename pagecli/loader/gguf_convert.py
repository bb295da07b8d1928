"""GGUF files to the Hugging Face layout, with the `gguf` package.

The config and the tokenizer (with its chat template) are read from the file's metadata into
a folder (config.json, tokenizer files); the engine reads the weights from the GGUF itself
(loader/gguf_weights.py). For transformers (baselines, tests) `write_float_weights` adds a
model.safetensors on demand: weights dequantized to float32, llama.cpp's Q/K row permutation
undone.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

# llama.cpp tensor names -> transformers names (per layer: "blk.N.<x>" -> "model.layers.N.<y>").
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Architectures whose Q/K rows llama.cpp's converter permuted (for its rope layout).
PERMUTED_ARCHS = {"llama"}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class GGUFError(ValueError):
    """The file is not a GGUF model pagecli can read."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers name of a llama.cpp tensor, or None for tensors with no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves in Q/K rows."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return w.transpose(1, 2).reshape(rows, *rest)


def field(reader, key: str, default=None):
    """A metadata value of the file, or `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json and the tokenizer of `gguf_path` into `out_dir`."""
    from transformers import AutoConfig, AutoTokenizer

    from pagecli.loader.gguf_weights import open_gguf

    reader = open_gguf(gguf_path)
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf_path}: unsupported GGUF architecture {arch!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    folder, filename = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=filename)
    config.architectures = [ARCHITECTURES[arch]]
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    config.save_pretrained(out_dir)
    if field(reader, "tokenizer.ggml.model") is None:
        return  # weights only (test files): token ids in, token ids out
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    template = field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)


def write_float_weights(gguf_path: Path, out_dir: Path) -> None:
    """Write the file's weights, dequantized to float32, as `out_dir`/model.safetensors."""
    from safetensors.torch import save_file

    from pagecli.loader.gguf_weights import iter_gguf_weights, open_gguf

    reader = open_gguf(gguf_path)
    try:
        tensors = dict(iter_gguf_weights(reader, keep_quantized=False))
    except GGUFError as exc:
        raise GGUFError(f"{gguf_path}: {exc}") from None
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
