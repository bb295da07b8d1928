"""KernelSettings (pagecli_kernels/settings.py): the CPU kernels' choices, set for the process
in one place, reported resolved, changed for a `with` block and put back after it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from pagecli.config import EngineConfig
from pagecli_kernels import native, quant_cpu
from pagecli_kernels.settings import KernelSettings, applied, apply, kernel_settings, report

pytestmark = pytest.mark.skipif(
    native.library() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}"
)

REPORT_KEYS = {"native", "layers", "isa", "prefetch", "gemm", "tiles", "int_dots"}
REPORT_KEYS |= {"vnni_q4_k", "small_batches", "bf16_gemm", "fused_rows", "timing", "cpu"}


def test_defaults_are_auto_and_values_are_checked():
    settings = KernelSettings()
    assert settings.isa == settings.gemm == settings.bf16_gemm == "auto" and settings.native
    assert settings.changed() == {}
    with pytest.raises(ValueError, match="kernels isa must be one of auto, portable"):
        KernelSettings(isa="avx9")
    with pytest.raises(ValueError, match="kernels native must be true or false"):
        KernelSettings(native="off")


def test_parse_names_and_values():
    parsed = KernelSettings.parse(" isa=portable, gemm=off,native=off ")
    assert parsed.changed() == {"isa": "portable", "gemm": "off", "native": False}
    assert KernelSettings.parse("") == KernelSettings.parse("auto") == KernelSettings()
    assert KernelSettings.parse({"tiles": "off"}) == KernelSettings(tiles="off")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        KernelSettings.parse("isa")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        KernelSettings.parse("speed=max")
    with pytest.raises(ValueError, match="layers must be on or off"):
        KernelSettings.parse("layers=maybe")
    assert KernelSettings.parse("fused_rows=48") == KernelSettings(fused_rows=48)
    with pytest.raises(ValueError, match="fused_rows must be a whole number"):
        KernelSettings.parse("fused_rows=many")
    with pytest.raises(ValueError, match="fused_rows must be 0 to 4096"):
        KernelSettings(fused_rows=5000)


def test_engine_config_takes_them_as_text_or_from_asdict():
    config = EngineConfig(kernels="isa=portable,small_batches=off")
    assert config.kernels == KernelSettings(isa="portable", small_batches="off")
    assert EngineConfig(**dataclasses.asdict(config)) == config  # the CLI's round trip
    assert EngineConfig().kernels == KernelSettings()
    with pytest.raises(ValueError, match="kernels gemm"):
        EngineConfig(kernels="gemm=mkl")


def test_report_names_the_resolved_values():
    got = report()
    assert set(got) == REPORT_KEYS
    assert "auto" not in got.values()
    assert got["native"] == got["layers"] == "on" and got["timing"] == "off"
    assert got["isa"] == native.isa() == quant_cpu.isa() == native.supported_isas()[-1]
    assert got["gemm"] == quant_cpu.gemm() and got["prefetch"] == quant_cpu.prefetch()
    assert got["tiles"] == ("on" if quant_cpu.tiles() else "off")
    assert got["vnni_q4_k"] == ("on" if quant_cpu.vnni_q4_k() else "off")
    assert got["bf16_gemm"] == quant_cpu.bf16_gemm()
    assert got["small_batches"] == "on"
    assert got["fused_rows"] == quant_cpu.fused_rows() == 8
    assert got["isa"] in got["cpu"]
    json.dumps(got)  # plain data


def test_the_context_manager_restores_the_previous_settings():
    before, reported = applied(), report()
    changes = dict(isa="portable", gemm="off", small_batches="off", native=False)
    with kernel_settings(**changes) as inside:
        assert applied() == inside == KernelSettings(**changes)
        got = report()
        assert got["isa"] == quant_cpu.isa() == native.isa() == "portable"
        assert got["gemm"] == "off" and quant_cpu.gemm() is None
        assert got["small_batches"] == "off" and got["native"] == "off"
        assert not native.enabled()
        with kernel_settings(gemm="blas"):  # nested: the outer block's choices stay
            assert report()["isa"] == "portable" and report()["gemm"] == "blas"
        with kernel_settings(fused_rows=40):
            assert quant_cpu.fused_rows() == 40 and report()["fused_rows"] == 40
        assert quant_cpu.fused_rows() == 8
        assert report() == got
    assert applied() == before and report() == reported and native.enabled()
    with pytest.raises(RuntimeError, match="boom"):
        with kernel_settings(prefetch="l1"):
            raise RuntimeError("boom")
    assert report() == reported
    with pytest.raises(ValueError, match="unknown settings"):
        with kernel_settings(speed="max"):
            pass


def _missing_choice() -> dict[str, str] | None:
    """A choice this CPU (or its kernel) cannot run, if there is one."""
    if "avx512" not in native.supported_isas():
        return {"isa": "avx512"}
    if not quant_cpu.bf16_tiles():
        return {"tiles": "on"}
    if "avx512_vnni" not in open("/proc/cpuinfo").read():
        return {"int_dots": "on"}
    return None


def test_a_choice_the_cpu_lacks_is_a_clear_error_and_changes_nothing():
    missing = _missing_choice()
    if missing is None:
        pytest.skip("this CPU runs every choice")
    ((name, value),) = missing.items()
    reported = report()
    wanted = KernelSettings(small_batches="off", **missing)  # a valid choice beside it
    with pytest.raises(ValueError, match=f"{name} '{value}'.*(not supported|not available)"):
        apply(wanted)
    assert applied() == KernelSettings() and report() == reported  # all or nothing


def test_settings_import_without_torch_and_report_without_building():
    """The config (and so `pagecli --help`) imports the settings: no torch. Before the
    library is asked for, the report gives the settings as they are and builds nothing; with
    the native kernels turned off, a choice is refused with the reason."""
    probe = """
import json, sys
from pagecli.config import EngineConfig
from pagecli_kernels import settings
light = "torch" not in sys.modules
first = settings.report()
settings.apply(settings.KernelSettings(native=False))  # only Python flags: builds nothing
try:
    settings.apply(settings.KernelSettings(isa="portable"))
    error = None
except ValueError as exc:
    error = str(exc)
print(json.dumps({"light": light, "first": first, "error": error}))
"""
    env = {**os.environ, "PAGECLI_NATIVE_KERNELS": "0"}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["light"]
    assert result["first"]["native"] == "not loaded" and result["first"]["isa"] == "auto"
    why = "the native kernels are unavailable: turned off by PAGECLI_NATIVE_KERNELS=0"
    assert why in result["error"]
