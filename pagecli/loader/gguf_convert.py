"""GGUF files to the Hugging Face layout, with the `gguf` package.

The config and the tokenizer (with its chat template) are read from the file's metadata into
a folder (config.json, tokenizer files), once per file; the engine reads the weights from the
GGUF itself (loader/gguf_weights.py). Each architecture's tensor names, stored conventions
and metadata map come from the family that runs it (models/base.GGUFArch, models/registry).
For transformers (baselines, tests) `write_float_weights` adds a model.safetensors on demand:
weights dequantized to float32 in transformers' conventions (llama.cpp's Q/K row permutation
undone, Gemma's stored 1 + w norms back to w, Qwen3.5's value heads back in transformers'
order).
"""

from __future__ import annotations

from pathlib import Path

from pagecli.loader.gguf_weights import GGUFError, file_arch


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
    arch = file_arch(reader, gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        config = _transformers_config(reader, gguf_path, arch)
    except ValueError as exc:  # a key the family needs, missing or malformed
        raise GGUFError(f"{gguf_path}: {str(exc).splitlines()[0]}") from None
    # the family's config map may name another architecture (a llama file with experts)
    config.architectures = list(getattr(config, "architectures", None) or [arch.hf_architecture])
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


def _transformers_config(reader, gguf_path: Path, family):
    """The transformers config of the file: the family's own map of the metadata
    (`GGUFArch.config`) for archs transformers cannot read, else what
    `AutoConfig.from_pretrained(gguf_file=)` makes of it (transformers' load_gguf_checkpoint,
    its config part) with the family's amendments (`GGUFArch.fix_config`)."""
    from transformers import CONFIG_MAPPING

    arch = reader.get("general.architecture")
    if family.config is not None:
        values = family.config(reader, arch)
        return CONFIG_MAPPING[values["model_type"]].from_dict(values)
    config = _transformers_values(reader, arch)
    if family.fix_config is not None:
        family.fix_config(reader, arch, config)
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def _transformers_values(reader, arch: str) -> dict:
    """The config values transformers' GGUF map reads from the file."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

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
    return config


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
    family = file_arch(reader, gguf_path)
    try:
        tensors = dict(iter_gguf_weights(reader, keep_quantized=False))
        if family.to_transformers is not None:
            arch = reader.get("general.architecture")
            values = family.config(reader, arch) if family.config else {}
            family.to_transformers(tensors, values)
    except (GGUFError, ValueError) as exc:
        raise GGUFError(f"{gguf_path}: {exc}") from None
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
