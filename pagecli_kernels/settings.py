"""KernelSettings: every choice of the CPU kernels, for the whole process, in one place.

The native library (native.py, csrc/) decides each of its paths from the CPU when it loads:
the instruction set, where the batch-1 kernels prefetch, who multiplies large batches, AMX's
tiles, the integer dots, the small-batch kernels, the bfloat16 GEMM. Those choices are state
of the process (of the C library); this module is the only one that changes them:

- `KernelSettings`: the choices, "auto" (the CPU's own) unless given, checked when made;
- `apply(settings)`: make them the process's (the engine applies its config's `kernels`);
- `report()`: what is in effect, resolved ("avx2", never "auto"), as one plain dict (`bench
  --json` and the engine's stats carry it);
- `kernel_settings(**changes)`: a `with` block under some changes (tests, benchmarks), the
  previous settings back at its end.

Importing this module does not import torch; `apply` and `report` import the kernel modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

Isa = Literal["auto", "portable", "avx2", "avx512"]
Prefetch = Literal["auto", "l1", "l2"]
Gemm = Literal["auto", "blas", "native", "off"]
Switch = Literal["auto", "off", "on"]
SmallBatches = Literal["auto", "off", "on"]
Bf16Gemm = Literal["auto", "off", "pairs", "tiles", "float32"]

# each choice field's values (the first is the default, the CPU's own choice)
CHOICES: dict[str, tuple[str, ...]] = {
    "isa": ("auto", "portable", "avx2", "avx512"),
    "prefetch": ("auto", "l1", "l2"),
    "gemm": ("auto", "blas", "native", "off"),
    "tiles": ("auto", "off", "on"),
    "int_dots": ("auto", "off", "on"),
    "vnni_q4_k": ("auto", "off", "on"),
    "small_batches": ("auto", "off", "on"),
    "bf16_gemm": ("auto", "off", "pairs", "tiles", "float32"),
}
SWITCHES = ("native", "layers", "timing")  # the bool fields
NUMBERS = ("fused_rows",)  # the int fields
FUSED_ROWS_MAX = 4096  # csrc/quant_linear_cpu.c's FUSED_ROWS_LIMIT
_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")


@dataclass(frozen=True)
class KernelSettings:
    """The CPU kernels' choices; "auto" leaves each to the CPU (see quant_cpu's functions of
    the same names for what auto picks). ValueError for a value outside a field's choices."""

    # the native kernels of attention and the small ops (False: torch's path, as without a
    # C compiler; the quantized products have no other path and keep theirs)
    native: bool = True
    # the one-call decoder layers (layers_cpu.py; needs `native`)
    layers: bool = True
    # the instruction-set path of every kernel; one the CPU lacks is refused by `apply`
    isa: Isa = "auto"
    # where the batch-1 kernels prefetch the weights (auto: the L2 on AMD before Zen 5)
    prefetch: Prefetch = "auto"
    # who multiplies the float32 panels of large batches; off: the fused path takes them
    gemm: Gemm = "auto"
    # batches of the 32-value-scale formats and Q6_K on AMX's tiles (on: needs AMX, AVX-512)
    tiles: Switch = "auto"
    # Q4_K/Q6_K products through integer dots (auto: AVX-512 VNNI at batch 1, AVX2 at any
    # batch; on: any batch on both, and AVX2's Q4_0/Q4_1 too; an engine of one sequence at a
    # time runs its steps under on: engine/spec_decode/invariance.py)
    int_dots: Switch = "auto"
    # Q4_K on AVX-512 VNNI's integer kernels where int_dots runs them (auto: on AMD's CPUs;
    # on Intel's the float kernels are the faster, and Q4_K keeps them at every batch)
    vnni_q4_k: Switch = "auto"
    # the small-batch kernels for 2-8 input rows (off: whole rows, the same bits; on: also
    # those auto keeps to Intel's CPUs, Q4_K's 2-4 and the half-sum 5-8, on any AVX-512 CPU)
    small_batches: SmallBatches = "auto"
    # bfloat16 batches: AMX's tiles, VDPBF16PS pairs, float32 panels, or off (torch's GEMM)
    bf16_gemm: Bf16Gemm = "auto"
    # batches of up to this many rows take the fused decode kernels, where a row's output
    # has the bits it has alone (0: auto, 8; speculative decoding asks for its verify rows)
    fused_rows: int = 0
    # the one-call layers sum their kernels' seconds (layers_cpu.kernel_seconds)
    timing: bool = False

    def __post_init__(self) -> None:
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"kernels {name} must be one of {', '.join(allowed)}; got {value!r}"
                )
        for name in SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"kernels {name} must be true or false; got {value!r}")
        rows = self.fused_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= FUSED_ROWS_MAX:
            raise ValueError(f"kernels fused_rows must be 0 to {FUSED_ROWS_MAX}; got {rows!r}")

    @classmethod
    def parse(cls, text: str | dict[str, object]) -> KernelSettings:
        """From "NAME=VALUE,..." (the CLI's --kernels; booleans as on/off; "" or "auto": all
        auto), or a dict of fields. ValueError for an unknown name or value."""
        if isinstance(text, dict):
            unknown = set(text) - set(FIELDS)
            if unknown:
                raise ValueError(f"kernels: unknown settings {sorted(unknown)}; known: {FIELDS}")
            return cls(**text)
        values: dict[str, object] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            if item == "auto":
                continue
            name, sep, value = (s.strip() for s in item.partition("="))
            if not sep or name not in FIELDS:
                raise ValueError(
                    f"kernels: {item!r} is not NAME=VALUE with NAME one of {', '.join(FIELDS)}"
                )
            if name in SWITCHES:
                if value.lower() not in (*_TRUE, *_FALSE):
                    raise ValueError(f"kernels {name} must be on or off; got {value!r}")
                values[name] = value.lower() in _TRUE
            elif name in NUMBERS:
                if not value.isdigit():
                    raise ValueError(f"kernels {name} must be a whole number; got {value!r}")
                values[name] = int(value)
            else:
                values[name] = value
        return cls(**values)

    def changed(self) -> dict[str, object]:
        """The fields that differ from the defaults."""
        default = KernelSettings()
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        }


FIELDS = tuple(f.name for f in dataclasses.fields(KernelSettings))
_state: dict = {"applied": KernelSettings()}


def applied() -> KernelSettings:
    """The settings the process runs under (the defaults until `apply`)."""
    return _state["applied"]


def apply(settings: KernelSettings) -> None:
    """Make `settings` the process's kernel choices, every field (an "auto" one back to the
    CPU's choice). ValueError naming the choice where this CPU, its kernel or this build
    cannot run it, or where the native library is unavailable; the previous settings then
    stay. Builds the library only where a choice needs it (a choice other than auto)."""
    previous = _state["applied"]
    changed = {name for name in FIELDS if getattr(settings, name) != getattr(previous, name)}
    try:
        if changed <= _STEP_FIELDS and _loaded():
            _push_step(settings)  # a step's change (spec_decode/invariance.py), every step
        else:
            _push(settings)
    except ValueError:
        _push(previous)
        raise
    _state["applied"] = settings


@contextmanager
def kernel_settings(**changes: object) -> Iterator[KernelSettings]:
    """`with kernel_settings(isa="portable"):` runs the block under the applied settings with
    those changes, and applies the previous ones again at its end (tests, benchmarks)."""
    unknown = set(changes) - set(FIELDS)
    if unknown:
        raise ValueError(f"kernels: unknown settings {sorted(unknown)}; known: {FIELDS}")
    previous = applied()
    settings = dataclasses.replace(previous, **changes)
    apply(settings)
    try:
        yield settings
    finally:
        apply(previous)


def report() -> dict[str, object]:
    """The kernel choices in effect, resolved, as one plain dict: "native" ("on", "off",
    "not loaded" before the library is built, or "unavailable: <why>"), "layers", "isa",
    "prefetch", "gemm", "tiles", "int_dots", "vnni_q4_k", "small_batches", "bf16_gemm",
    "fused_rows", "timing" and "cpu"
    (what the library found). Before the library loads the other choices are the settings
    as given ("auto"); reading this never builds the library."""
    from pagecli_kernels import layers_cpu, native, quant_cpu

    settings = applied()
    out: dict[str, object] = {f: getattr(settings, f) for f in FIELDS}
    for name in SWITCHES:
        out[name] = "on" if out[name] else "off"
    status = native.status()
    if status != "loaded":
        out["native"] = status
        return out
    out.update(
        native="on" if native.enabled() else "off",
        layers="on" if layers_cpu.enabled() else "off",
        isa=native.isa(),
        prefetch=quant_cpu.prefetch(),
        gemm=quant_cpu.gemm() or "off",
        tiles="on" if quant_cpu.tiles() else "off",
        int_dots="on" if quant_cpu.int_dots() else "off",
        vnni_q4_k="on" if quant_cpu.vnni_q4_k() else "off",
        small_batches="on" if quant_cpu.small_batches() else "off",
        bf16_gemm=quant_cpu.bf16_gemm(),
        fused_rows=quant_cpu.fused_rows(),
        timing="on" if layers_cpu.timing() else "off",
        cpu=_cpu_line(native.cpu_features()),
    )
    return out


def _cpu_line(found: dict[str, object]) -> str:
    """What the library found, in a few words: "AMD family 0x19: avx2"."""
    vendor = "Intel" if found.get("intel") else "other"
    if found.get("amd_family"):
        vendor = f"AMD family {found['amd_family']:#x}"
    flags = [str(found["isas"][-1])] if found.get("isas") else []
    flags += [name for name in ("avx512_bf16", "avx512_vnni") if found.get(name)]
    if found.get("amx"):
        flags.append("amx" if found.get("amx_granted") else "amx (not granted)")
    return f"{vendor}: {', '.join(flags)}"


# the fields a decode step may change (spec_decode/invariance.py): with the library loaded,
# only their setters run (the others already hold what the applied settings say)
_STEP_FIELDS = frozenset({"int_dots", "fused_rows"})


def _loaded() -> bool:
    from pagecli_kernels import native

    return native.loaded()


def _push_step(settings: KernelSettings) -> None:
    """Set the choices of _STEP_FIELDS of `settings` in the loaded library."""
    from pagecli_kernels import quant_cpu

    quant_cpu._configure_step(settings.int_dots, settings.fused_rows)


def _push(settings: KernelSettings) -> None:
    """Set every choice of `settings` in the kernel modules."""
    from pagecli_kernels import layers_cpu, native, quant_cpu

    needs_library = settings.fused_rows != 0 or any(
        getattr(settings, name) != "auto" for name in CHOICES
    )
    if needs_library and native.library() is None:
        chosen = {name: getattr(settings, name) for name in CHOICES}
        chosen = {name: value for name, value in chosen.items() if value != "auto"}
        raise ValueError(
            f"kernels {chosen}: the native kernels are unavailable: {native.unavailable_reason()}"
        )
    isa = None if settings.isa == "auto" else settings.isa
    if native.loaded() or needs_library:
        native._configure(settings.native, isa)
        quant_cpu._configure(
            settings.prefetch,
            settings.gemm,
            settings.tiles,
            settings.int_dots,
            settings.small_batches,
            settings.bf16_gemm,
            settings.fused_rows,
            settings.vnni_q4_k,
        )
    else:  # nothing to tell a library not built yet: it loads with the CPU's choices
        native._configure(settings.native, None)
    layers_cpu._configure(settings.layers, settings.timing)
