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
