"""GGUF files to the Hugging Face layout, with the `gguf` package.

The config and the tokenizer (with its chat template) are read from the file's metadata into
a folder (config.json, tokenizer files), once per file; the engine reads the weights from the
GGUF itself (loader/gguf_weights.py). For transformers (baselines, tests) `write_float_weights`
adds a model.safetensors on demand: weights dequantized to float32, llama.cpp's Q/K row
permutation undone.
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


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict:
    """Write config.json and the tokenizer of `gguf_path` into `out_dir`; returns what the
    folder's marker records: {"tokenizer": "tokenizers" | "transformers" | None}.

    The metadata comes from the process's one parse of the file (loader/gguf_file.py); the
    config and the tokenizer are still transformers' own, built as its `gguf_file=` loaders
    build them (config: the same key table; tokenizer: the same class and converter) without
    gguf.GGUFReader's seconds-long walk of the vocabulary.
    """
    from pagecli.loader.gguf_weights import open_gguf
    from pagecli.loader.model_config import FULL_CONFIG_FILE

    reader = open_gguf(gguf_path)
    arch = reader.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf_path}: unsupported GGUF architecture {arch!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _transformers_config(reader, gguf_path)
    config.architectures = [ARCHITECTURES[arch]]
    config.tie_word_embeddings = not any(t.name == "output.weight" for t in reader.tensors)
    config.save_pretrained(out_dir)
    (out_dir / FULL_CONFIG_FILE).write_text(config.to_json_string(use_diff=False))
    if reader.get("tokenizer.ggml.model") is None:
        return {"tokenizer": None}  # weights only (test files): token ids in, token ids out
    tokenizer = _transformers_tokenizer(gguf_path, config)
    template = reader.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    return {"tokenizer": _tokenizer_backend(out_dir, tokenizer)}


def _transformers_config(reader, gguf_path: Path):
    """The transformers config of the file, as `AutoConfig.from_pretrained(gguf_file=)` makes
    it for these architectures (transformers' load_gguf_checkpoint, its config part)."""
    from transformers import CONFIG_MAPPING

    try:
        from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    except ImportError:  # an older transformers: its own (slower) reading of the file
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    arch = reader.get("general.architecture")
    # transformers tests `"mistral" in [general.name]`: the name must be exactly "mistral"
    renamed = "mistral" if "llama" in arch and reader.get("general.name") == "mistral" else arch
    config: dict = {"tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors)}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(
        renamed, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}
    )
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key in reader.keys():
        prefix, _, name = key.replace(arch, renamed).partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name)
        if target is None or target == -1:
            continue
        value = reader.get(key)
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers reads one-element arrays as their element
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, renamed)
        config[target] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in reader:
        config["vocab_size"] = len(reader.get("tokenizer.ggml.tokens"))
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def _transformers_tokenizer(gguf_path: Path, config):
    """transformers' tokenizer of the file: the class AutoTokenizer picks for this config,
    built from the GGUF by that class (AutoTokenizer itself would read the config again
    through gguf.GGUFReader)."""
    from transformers import AutoTokenizer

    folder, filename = str(gguf_path.parent), gguf_path.name
    try:
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

        cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    except ImportError:  # transformers 4: its AutoTokenizer, slower but the same result
        return AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    if not isinstance(cls, type) or cls.__name__ == "MistralCommonBackend":
        cls = TokenizersBackend  # what AutoTokenizer uses for a folder without Mistral files
    return cls.from_pretrained(folder, gguf_file=filename)


def _tokenizer_backend(folder: Path, tokenizer) -> str:
    """`tokenizers` when loader/light_tokenizer.py reproduces `tokenizer` from the folder,
    else `transformers`."""
    from pagecli.loader.light_tokenizer import LightTokenizer, agrees_with

    if not LightTokenizer.suits(folder):
        return "transformers"
    try:
        light = LightTokenizer(folder)
    except Exception:  # a tokenizer.json the installed `tokenizers` cannot read
        return "transformers"
    return "tokenizers" if agrees_with(light, tokenizer) else "transformers"


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
