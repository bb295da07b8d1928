"""Model resolution and loading: GGUF conversion, presets, and one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagecli import LLM, SamplingParams
from pagecli.loader.gguf_weights import unpermute_qk
from pagecli.loader.resolve import ModelLoadError, default_gguf_path, resolve_model
from pagecli.models.registry import UnsupportedModelError


def test_gguf_conversion_matches_transformers_gguf_loader(default_model_dir):
    """Our dequantization and Q/K un-permutation give exactly transformers' tensors."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(default_model_dir))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(
        str(default_gguf_path()), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as ours:
        assert set(ours.keys()) == set(theirs)
        for name in ours.keys():
            assert torch.equal(ours.get_tensor(name), torch.as_tensor(theirs[name])), name


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, hidden = 3, 8, 5
    w = torch.randn(heads * head_dim, hidden)
    # llama.cpp's convert_hf_to_gguf permute()
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_qk(permuted, heads), w)


def test_default_model_folder_is_cached(default_model_dir):
    assert resolve_model(None).path == default_model_dir
    assert (default_model_dir / "pagecli-converted.json").is_file()
    assert json.loads((default_model_dir / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"
    ]


def test_preset_with_dummy_weights_runs():
    llm = LLM("preset:smollm2-135m", load_format="dummy", num_kv_blocks=32, block_size=4)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")


def test_too_big_for_memory_names_a_smaller_dtype():
    with pytest.raises(ModelLoadError, match=r"float32 .* try --dtype bfloat16"):
        LLM("preset:llama-2-7b", load_format="dummy", dtype="float32", num_kv_blocks=4)


def test_unknown_preset():
    with pytest.raises(ModelLoadError, match="unknown preset 'nope'.*llama-3-8b"):
        resolve_model("preset:nope")


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda tmp: tmp / "missing", "no such file or directory"),
        (lambda tmp: tmp, "not a model folder"),
        (lambda tmp: (tmp / "notes.txt").write_text("x") and tmp / "notes.txt", "not a model"),
    ],
)
def test_bad_local_paths(tmp_path, make, message):
    with pytest.raises(ModelLoadError, match=message):
        resolve_model(str(make(tmp_path)))


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGECLI_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        resolve_model(str(bad))


def test_corrupt_safetensors(tmp_path, tiny_models):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], folder)
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        LLM(str(folder))


def test_hub_id_not_cached_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match="not in the local Hugging Face cache"):
        resolve_model("nobody/not-a-model")


def test_unsupported_architecture(tmp_path, tiny_models):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises((UnsupportedModelError, ModelLoadError), match="GPT2LMHeadModel"):
        LLM(str(folder))


def test_chat_template_fallback_and_override(tmp_path, default_model_dir, tiny_models, capfd):
    folder = tmp_path / "base"
    # the small files copied, the weights (half a GB) linked: every run's temporary folder
    # is kept a while, and a copy would take that much disk each time
    shutil.copytree(default_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    for weights in Path(default_model_dir).glob("*.safetensors"):
        (folder / weights.name).symlink_to(weights)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    llm = LLM(str(folder), num_kv_blocks=64)
    assert "no chat template" in capfd.readouterr().err
    assert llm.tokenizer.template_source == "fallback"
    (text,) = [llm.encode_prompt([{"role": "user", "content": "hi"}])[1]]
    assert text == "User: hi\n\nAssistant:"
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    llm = LLM(str(folder), num_kv_blocks=64, chat_template=str(template))
    assert llm.encode_prompt([{"role": "user", "content": "hi"}])[1] == "<user>hi"
