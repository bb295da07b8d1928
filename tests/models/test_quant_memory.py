"""Memory of quantized weights: what is resident, and what the check before loading counts.

- The default model (Q4_1 projections, Q8_0 embedding) loaded: its weights take at most 1.15x
  the GGUF file's tensor bytes, summed over the buffers and measured as the growth of the
  process's anonymous RSS across loading (file-backed RSS there is library code that the
  load imports, shared and not weights; the KV cache is subtracted).
- A GGUF's blocks are read in place from the file's memory map: after loading a 1B-wide
  Q4_K_M file (four layers, 0.2 GB, benchmarks/shaped_gguf.py's writer) and generating, the
  process's anonymous memory has grown by at most 5% of the file plus the KV cache and the
  step workspace the engine counts, while its file-backed pages have grown by the weights.
- A 7B Q4_K_M GGUF is accepted on a 24 GiB machine and refused there in float32. The file is
  a real GGUF header (the gguf package's writer, llama.cpp's Q4_K_M type mix) over a sparse
  data region: GGUFReader maps it, nothing of its 4 GB is ever written or read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagecli.layers.quant_linear import QuantEmbedding, QuantLinear
from pagecli.loader.gguf_weights import gguf_tensor_bytes
from pagecli.loader.resolve import ModelLoadError, ModelSource, default_gguf_path
from pagecli.loader.weight_plan import plan_weights
from pagecli.loader.weights import check_fits

LIMIT = 1.15


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight of a loaded model: quantized blocks, float parts, parameters."""
    total = 0
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            total += module.nbytes
    total += sum(p.numel() * p.element_size() for p in model.parameters())
    return total


def test_default_model_weights_stay_within_the_file_size():
    from pagecli import LLM

    llm = LLM(num_kv_blocks=16)
    ours = weight_bytes(llm.engine.runner.model)
    file_bytes = gguf_tensor_bytes(default_gguf_path())
    assert ours <= LIMIT * file_bytes, (ours, file_bytes)


RSS_SCRIPT = """
import json, sys, torch
from pagecli import LLM
from pagecli_kernels import native, quant_cpu
from transformers import AutoTokenizer
from pagecli.loader.resolve import resolve_model

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

source = resolve_model(None)
AutoTokenizer.from_pretrained(str(source.path))  # the tokenizer's own memory, not weights
native.library(), quant_cpu.library()
import gguf, transformers.models.llama  # modules the load imports, not weights
import numpy.random, torch._dynamo  # imported during the load too (10+ MB of module state)
before = rss()
llm = LLM(num_kv_blocks=1, kv_cache_memory=0.001)
kv = llm.engine.runner.kv_cache
print(json.dumps({"delta": rss() - before, "kv": kv.numel() * kv.element_size()}))
"""


def test_default_model_rss_stays_within_the_file_size():
    out = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    file_bytes = gguf_tensor_bytes(default_gguf_path())
    grown = found["delta"] - found["kv"]
    assert grown <= LIMIT * file_bytes, f"RSS grew {grown / 1e6:.1f} MB for {file_bytes / 1e6:.1f}"
    print(f"RssAnon grew {grown / 1e6:.1f} MB for {file_bytes / 1e6:.1f} MB of GGUF tensors")


MAPPED_SCRIPT = """
import json, sys, torch
from pagecli import LLM, SamplingParams
from pagecli_kernels import native, quant_cpu
import gguf, numpy.random

def rss():
    found = {}
    for line in open("/proc/self/status"):
        if line.startswith(("RssAnon:", "RssFile:")):
            found[line.split(":")[0]] = int(line.split()[1]) * 1024
    return found

native.library(), quant_cpu.library()
before = rss()
llm = LLM(sys.argv[1], kv_cache_memory=1 / 16, max_num_batched_tokens=256, max_num_seqs=8)
loaded = rss()
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
llm.generate([{"prompt_token_ids": list(range(100, 164))}], params)
after = rss()
runner = llm.engine.runner
print(json.dumps({
    "loaded_anon": loaded["RssAnon"] - before["RssAnon"],
    "anon": after["RssAnon"] - before["RssAnon"],
    "file": after["RssFile"] - before["RssFile"],
    "kv": runner.kv_cache.numel() * runner.kv_cache.element_size(),
    "memory": runner.memory.as_dict(),
}))
"""
FIXED_BYTES = 32 << 20  # Python objects of the model and the engine, allocator slack


@pytest.fixture(scope="module")
def shaped_1b_4_layers(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        import shaped_gguf
    finally:
        sys.path.pop(0)
    path = shaped_gguf.ensure_file(tmp_path_factory.mktemp("shaped"), "1b", "q4_k_m", 4)
    yield path
    path.unlink()  # 225 MB: pytest keeps the temporary folders of the last runs


def test_gguf_blocks_are_read_in_place_not_copied(shaped_1b_4_layers):
    path = shaped_1b_4_layers
    size = path.stat().st_size
    assert 150e6 < size < 400e6
    out = subprocess.run(
        [sys.executable, "-c", MAPPED_SCRIPT, str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    memory = found["memory"]
    assert memory["mapped"] > 0.97 * size and memory["kv"] == found["kv"]
    allowed = 0.05 * size + found["kv"] + memory["workspace"] + FIXED_BYTES
    print(
        f"file {size / 1e6:.0f} MB: anonymous +{found['loaded_anon'] / 1e6:.1f} MB loaded, "
        f"+{found['anon'] / 1e6:.1f} MB after a step (allowed {allowed / 1e6:.0f} MB: KV "
        f"{found['kv'] / 1e6:.0f}, workspace {memory['workspace'] / 1e6:.0f}); file pages "
        f"+{found['file'] / 1e6:.0f} MB"
    )
    assert found["loaded_anon"] <= 0.05 * size + found["kv"] + FIXED_BYTES
    assert found["anon"] <= allowed
    assert found["file"] > 0.9 * size  # the weights the step read: the file's own pages


# llama.cpp's Q4_K_M for Llama-2-7B: Q4_K, with Q6_K for half the v and down projections
# (use_more_bits) and for the output projection.
HIDDEN, INTER, LAYERS, VOCAB = 4096, 11008, 32, 32000


def _q4_k_m_tensors():
    more_bits = {i for i in range(LAYERS) if i < LAYERS // 8 or i >= 7 * LAYERS // 8}
    more_bits |= set(range(LAYERS // 8, 7 * LAYERS // 8, 3))
    yield "token_embd.weight", (VOCAB, HIDDEN), "Q4_K"
    yield "output.weight", (VOCAB, HIDDEN), "Q6_K"
    yield "output_norm.weight", (HIDDEN,), "F32"
    for i in range(LAYERS):
        big = "Q6_K" if i in more_bits else "Q4_K"
        yield f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32"
        yield f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32"
        for name in ("attn_q", "attn_k", "attn_output"):
            yield f"blk.{i}.{name}.weight", (HIDDEN, HIDDEN), "Q4_K"
        yield f"blk.{i}.attn_v.weight", (HIDDEN, HIDDEN), big
        yield f"blk.{i}.ffn_gate.weight", (INTER, HIDDEN), "Q4_K"
        yield f"blk.{i}.ffn_up.weight", (INTER, HIDDEN), "Q4_K"
        yield f"blk.{i}.ffn_down.weight", (HIDDEN, INTER), big


def write_sparse_gguf(path: Path) -> int:
    """A 7B Q4_K_M GGUF header with a sparse data region; returns the tensors' bytes."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(32)
    total = 0
    for name, shape, kind in _q4_k_m_tensors():
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        total += nbytes
        raw = None if kind == "F32" else qtype
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    reader_end = path.stat().st_size
    with open(path, "r+b") as f:  # the data region: a hole
        f.truncate(reader_end + total + 2**20)
    return total


@pytest.fixture(scope="module")
def sparse_7b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("7b")
    path = folder / "llama-2-7b.Q4_K_M.gguf"
    total = write_sparse_gguf(path)
    source = ModelSource("llama-2-7b.Q4_K_M.gguf", "gguf", folder, gguf_file=path)
    return source, total


def test_7b_q4_k_m_fits_a_24_gib_machine(sparse_7b, monkeypatch):
    source, total = sparse_7b
    cpu = torch.device("cpu")
    plan = plan_weights(source, "auto", cpu, torch.float32)
    assert plan.mode == "gguf" and len(plan.quantized_names) == 2 + 7 * LAYERS
    assert 3.8e9 < plan.resident_bytes < 4.2e9  # the file's blocks, plus the F32 norms
    monkeypatch.setattr("pagecli.loader.weights.available_memory", lambda device: 24 * 2**30)
    check_fits(plan.resident_bytes, torch.float32, cpu, source.name, in_dtype=False)
    dequantized = plan_weights(source, "none", cpu, torch.float32)
    assert dequantized.resident_bytes > 26e9  # float32: 27 GB
    with pytest.raises(ModelLoadError, match="weights need"):
        check_fits(dequantized.resident_bytes, torch.float32, cpu, source.name, in_dtype=False)
