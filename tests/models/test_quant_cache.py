"""`--quantization` on safetensors: quantized once into a cached GGUF, then mapped.

- The first load writes the cache file (named by the checkpoint's files and the mode), the
  second reads it without quantizing again, and both give the same greedy tokens; the blocks
  are counted as mapped weights.
- A changed checkpoint gets a new file; a load that fails half-way leaves no file behind.
- The streaming reader gives safetensors' own tensors; a corrupt header is one clear error.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pagecli import LLM, SamplingParams
from pagecli.loader import quant_cache
from pagecli.loader.resolve import ModelLoadError, resolve_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}]


@pytest.fixture()
def checkpoint(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGECLI_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama3"], folder)
    return folder


def cached_files(tmp_path):
    folder = tmp_path / "cache" / "quantized"
    return sorted(folder.iterdir()) if folder.exists() else []


def test_first_load_writes_the_cache_and_the_second_maps_it(checkpoint, tmp_path, monkeypatch):
    first = LLM(str(checkpoint), quantization="q8_0", num_kv_blocks=32)
    (path,) = cached_files(tmp_path)
    assert path.suffix == ".gguf" and ".q8_0." in path.name
    written = path.stat().st_mtime_ns
    memory = first.engine.runner.memory
    assert (
        memory.mapped > 0
        and memory.mapped
        == sum(m.nbytes for m in first.engine.runner.model.modules() if hasattr(m, "parts"))
        + first.engine.runner.model.embed_tokens.nbytes
    )
    tokens = first.generate(PROMPT, PARAMS)[0].token_ids
    del first

    def no_quantizing(*args):
        raise AssertionError("quantized again")

    monkeypatch.setattr(quant_cache, "write_cache", no_quantizing)
    second = LLM(str(checkpoint), quantization="q8_0", num_kv_blocks=32)
    assert second.generate(PROMPT, PARAMS)[0].token_ids == tokens
    assert path.stat().st_mtime_ns == written and cached_files(tmp_path) == [path]


def test_a_changed_checkpoint_or_mode_gets_its_own_file(checkpoint, tmp_path):
    source = resolve_model(str(checkpoint))
    q8 = quant_cache.cache_path(source, "q8_0")
    assert quant_cache.cache_path(source, "q4_k") != q8
    weights = next(checkpoint.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert quant_cache.cache_path(source, "q8_0") != q8


def test_a_failed_quantization_leaves_no_file(checkpoint, tmp_path, monkeypatch):
    import pagecli.loader.quantize as quantize

    calls = []
    real = quantize.quantize_weight

    def fail_third(name, tensor, mode):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C half-way through
        return real(name, tensor, mode)

    monkeypatch.setattr(quantize, "quantize_weight", fail_third)
    with pytest.raises(KeyboardInterrupt):
        LLM(str(checkpoint), quantization="q8_0", num_kv_blocks=32)
    assert len(calls) == 3
    folder = tmp_path / "cache" / "quantized"
    assert not folder.exists() or list(folder.iterdir()) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_streaming_reader_gives_safetensors_tensors(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(7, 33, generator=gen).to(dtype),
        "b.bias": torch.randn(5, generator=gen).to(dtype),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    found = quant_cache.stored_tensors(tmp_path, "m")
    assert {t.name for t in found} == set(tensors)
    for t in found:
        assert torch.equal(quant_cache.read_tensor(t), tensors[t.name])


def test_a_corrupt_header_is_one_clear_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="corrupt safetensors file"):
        quant_cache.stored_tensors(tmp_path, "m")
