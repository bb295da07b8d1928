"""A small tokenizer with tool-call tags as single special tokens, as the real vocabularies
have them (Qwen's `<tool_call>`, Mistral's `[TOOL_CALLS]` and `[ARGS]`, Llama 3.1's
`<|python_tag|>`): the default model's tokenizer with some of its unused special tokens
(ids 3-8, GitHub and Jupyter markers no chat uses) renamed, so its 49,152 logits still cover
them. `<tool_call>` and `</tool_call>` are flagged non-special as in Qwen's tokenizer.json
(they stay in decoded text); the others special as in Mistral's and Llama's (decoding with
skip_special_tokens drops them unless kept)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TAGS = {
    "<tool_call>": 3,
    "</tool_call>": 4,
    "[TOOL_CALLS]": 5,
    "[ARGS]": 6,
    "<|python_tag|>": 7,
    "[CALL_ID]": 8,
}
NOT_SPECIAL = {"<tool_call>", "</tool_call>"}


def tool_tokenizer_json(source: Path) -> str:
    """The default model's tokenizer.json with the tags in place of ids 3-8."""
    data = json.loads((source / "tokenizer.json").read_text())
    names = {i: tag for tag, i in TAGS.items()}
    vocab = data["model"]["vocab"]
    for token in data["added_tokens"]:
        tag = names.get(token["id"])
        if tag is not None:
            del vocab[token["content"]]
            vocab[tag] = token["id"]
            token["content"], token["special"] = tag, tag not in NOT_SPECIAL
    return json.dumps(data, ensure_ascii=False)


def tool_model_dir(root: Path, template: Path) -> Path:
    """The default model's float checkpoint under `root` (weights linked, not copied) with
    the tool tokenizer and `template` as its chat template."""
    from pagecli.loader.resolve import float_checkpoint, resolve_model

    source = float_checkpoint(resolve_model(None))
    root.mkdir(parents=True, exist_ok=True)
    os.symlink(source / "model.safetensors", root / "model.safetensors")
    shutil.copy(source / "config.json", root / "config.json")
    (root / "tokenizer.json").write_text(tool_tokenizer_json(source))
    shutil.copy(source / "tokenizer_config.json", root / "tokenizer_config.json")
    shutil.copy(template, root / "chat_template.jinja")
    return root
