"""`--dtype auto`: bfloat16 only where the CPU multiplies it natively and the probe agrees."""

from __future__ import annotations

import time

import pytest
import torch

from pagecli.engine import dtype_choice
from pagecli.engine.dtype_choice import choose_cpu_dtype, choose_dtype


def test_no_native_bf16_flag_means_float32_without_probing():
    def probe():
        raise AssertionError("the probe must not run without a native bfloat16 flag")

    choice = choose_cpu_dtype({"avx2", "avx512f", "avx512bw", "fma"}, probe)
    assert choice.dtype == torch.float32
    assert "no native bfloat16" in choice.reason


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16"])
def test_native_flag_and_a_fast_probe_mean_bfloat16(flag):
    choice = choose_cpu_dtype({"avx512f", flag}, lambda: 3.2)
    assert choice.dtype == torch.bfloat16 and choice.name == "bfloat16"
    assert flag in choice.reason and "3.2x" in choice.reason


def test_a_slow_probe_overrules_the_flag():
    choice = choose_cpu_dtype({"avx512_bf16"}, lambda: 0.8)
    assert choice.dtype == torch.float32
    assert "avx512_bf16" in choice.reason and "only 0.8x" in choice.reason


def test_this_machine_follows_its_flags():
    flags = dtype_choice.cpu_flags()
    choice = choose_dtype("auto", torch.device("cpu"))
    if not set(dtype_choice.NATIVE_BF16_FLAGS) & flags:
        assert choice.dtype == torch.float32  # e.g. the 2-core CI machine (AVX-512, no BF16)
    assert choice.reason.startswith("auto: ")


def test_explicit_dtypes_and_cuda_auto():
    assert choose_dtype("float32", torch.device("cpu")).dtype == torch.float32
    assert choose_dtype("float16", torch.device("cpu")).reason == "float16, as asked (--dtype)"
    assert choose_dtype("auto", torch.device("cuda")).dtype == torch.bfloat16


def test_probe_is_sub_second_and_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGECLI_CACHE_DIR", str(tmp_path))
    start = time.perf_counter()
    speedup = dtype_choice.probe_bf16_speedup()
    assert time.perf_counter() - start < 1.0 and speedup > 0
    calls = []

    def probe():
        calls.append(1)
        return 2.5

    flags = {"amx_bf16"}
    assert dtype_choice.cached_probe(flags, probe) == 2.5
    assert dtype_choice.cached_probe(flags, probe) == 2.5  # from the cache file
    assert len(calls) == 1
    assert (tmp_path / "cpu_dtype_probe.json").is_file()
    assert dtype_choice.cached_probe({"avx512_bf16"}, probe) == 2.5  # other flags: new key
    assert len(calls) == 2


def test_quantized_weights_mean_float32_without_probing(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("quantized weights must not probe bfloat16")

    monkeypatch.setattr(dtype_choice, "choose_cpu_dtype", refuse)
    choice = choose_dtype("auto", torch.device("cpu"), quantized=True)
    assert choice.dtype == torch.float32 and "quantized" in choice.reason
    # asked for, bfloat16 stays bfloat16; CUDA dequantizes, so it keeps its own default
    assert choose_dtype("bfloat16", torch.device("cpu"), quantized=True).dtype == torch.bfloat16
    assert choose_dtype("auto", torch.device("cuda"), quantized=True).dtype == torch.bfloat16


def test_quantizes_agrees_with_the_weight_plan(tiny_models):
    from pagecli.loader.resolve import resolve_model
    from pagecli.loader.weight_plan import plan_weights, quantizes

    cpu = torch.device("cpu")
    cases = [
        (resolve_model(None), "auto"),  # the default GGUF: its own blocks
        (resolve_model(None), "none"),
        (resolve_model(str(tiny_models["llama3"])), "auto"),  # safetensors, as stored
        (resolve_model(str(tiny_models["llama3"])), "q8_0"),
        (resolve_model(str(tiny_models["llama3"])), "q4_k"),
    ]
    for source, mode in cases:
        expected = plan_weights(source, mode, cpu, torch.float32).mode != "none"
        assert quantizes(source, mode, cpu) is expected, (source.name, mode)
    assert quantizes(resolve_model(None), "auto", cpu) is True  # the kernels are built here
    assert quantizes(resolve_model(None), "auto", cpu, load_format="dummy") is False
    assert quantizes(resolve_model(None), "auto", torch.device("cuda")) is False


def test_the_default_model_runs_in_float32_under_auto():
    from pagecli import LLM

    engine = LLM(num_kv_blocks=16).engine
    assert engine.dtype == torch.float32
    assert engine.dtype_choice.reason.startswith("auto: float32, the quantized weights")
