"""Options shared by every command: the engine options (1:1 with EngineConfig), the sampling
options (1:1 with SamplingParams) and `--verbose`, added to a command by a decorator.

A command decorated with `@engine_options` receives one `engine_config: EngineConfig` argument
instead of a dozen flags, so `chat` and `bench` declare them once, here.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Optional, get_args

import typer

from pagecli.config import (
    AttentionImpl,
    Device,
    DType,
    EngineConfig,
    LoadFormat,
    PreemptionMode,
    Quantization,
)
from pagecli.sampling_params import SamplingParams

MODEL_PANEL = "Model"
ENGINE_PANEL = "Engine"
SPEC_PANEL = "Speculative decoding"
SAMPLING_PANEL = "Sampling"


class CliError(Exception):
    """A user-caused failure: printed as one `pagecli: ` line, then exit with `exit_code`."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _choices(name: str, literal: Any) -> type[enum.Enum]:
    """An Enum of a config Literal's values, which Typer shows and checks as a choice."""
    return enum.Enum(name, {v: v for v in get_args(literal)}, type=str)


DTypeChoice = _choices("DTypeChoice", DType)
DeviceChoice = _choices("DeviceChoice", Device)
LoadFormatChoice = _choices("LoadFormatChoice", LoadFormat)
PreemptionModeChoice = _choices("PreemptionModeChoice", PreemptionMode)
AttentionImplChoice = _choices("AttentionImplChoice", AttentionImpl)
QuantizationChoice = _choices("QuantizationChoice", Quantization)


def _opt(panel: str, help: str, *decls: str, **kw: Any) -> typer.models.OptionInfo:
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


# One entry per EngineConfig field: (annotation, option). Names are the field names.
ENGINE_OPTIONS: dict[str, tuple[Any, typer.models.OptionInfo]] = {
    "model": (
        Optional[str],
        _opt(
            MODEL_PANEL,
            "A model folder (HF layout), a .gguf file, a hub id, or preset:NAME. "
            "Default: SmolLM2-135M-Instruct.",
            "--model",
            "-m",
            show_default=False,
        ),
    ),
    "dtype": (
        DTypeChoice,
        _opt(
            MODEL_PANEL,
            "Weight and KV dtype (auto: bf16 on CUDA and on CPUs that multiply bf16 natively, "
            "AMX or AVX512_BF16; else fp32).",
        ),
    ),
    "device": (DeviceChoice, _opt(MODEL_PANEL, "Where to run (auto: CUDA when available).")),
    "load_format": (LoadFormatChoice, _opt(MODEL_PANEL, "Weight format; dummy = random weights.")),
    "quantization": (
        QuantizationChoice,
        _opt(
            MODEL_PANEL,
            "Weights in memory (CPU): auto keeps a GGUF's block formats; none dequantizes; "
            "q8_0/q4_k quantize a safetensors model at load time.",
        ),
    ),
    "chat_template": (
        Optional[Path],
        _opt(MODEL_PANEL, "A Jinja chat template file overriding the model's.", show_default=False),
    ),
    "block_size": (int, _opt(ENGINE_PANEL, "Tokens per KV block (a power of two, 1..128).")),
    "max_num_seqs": (int, _opt(ENGINE_PANEL, "Most sequences running at once.")),
    "max_num_batched_tokens": (int, _opt(ENGINE_PANEL, "Most tokens in one step.")),
    "max_model_len": (
        Optional[int],
        _opt(ENGINE_PANEL, "Context length (default: the model's).", show_default=False),
    ),
    "kv_cache_memory": (float, _opt(ENGINE_PANEL, "GiB of KV cache on the CPU.")),
    "gpu_memory_utilization": (float, _opt(ENGINE_PANEL, "Share of GPU memory to use (0, 1].")),
    "num_kv_blocks": (
        Optional[int],
        _opt(
            ENGINE_PANEL,
            "Exact number of KV blocks (overrides the memory budget).",
            show_default=False,
        ),
    ),
    "enable_prefix_caching": (
        bool,
        _opt(
            ENGINE_PANEL,
            "Reuse the KV of shared prompt prefixes (--no-prefix-caching turns it off).",
            "--enable-prefix-caching/--no-prefix-caching",
        ),
    ),
    "hybrid_kv_cache": (
        bool,
        _opt(
            ENGINE_PANEL,
            "Models with sliding-window layers beside full attention: each layer type keeps "
            "its own block table and a window's old blocks go back to the pool "
            "(--no-hybrid-kv-cache: every layer keeps every block).",
            "--hybrid-kv-cache/--no-hybrid-kv-cache",
        ),
    ),
    "state_snapshot_stride": (
        int,
        _opt(
            ENGINE_PANEL,
            "Models with recurrent layers (Qwen3.5): keep a copy of a sequence's state every N "
            "blocks, so that a prompt that shares its start (a chat's next turn) resumes "
            "there (0: no copies, no prefix hits).",
        ),
    ),
    "state_snapshots": (
        Optional[int],
        _opt(
            ENGINE_PANEL,
            "State copies kept for those hits, least recently used evicted first (default: "
            "one per 8 of --max-num-seqs, at least 4); they count in --kv-cache-memory.",
            show_default=False,
        ),
    ),
    "preemption_mode": (PreemptionModeChoice, _opt(ENGINE_PANEL, "What preemption does.")),
    "swap_space": (float, _opt(ENGINE_PANEL, "GiB of host memory for swapped-out blocks.")),
    "enforce_eager": (bool, _opt(ENGINE_PANEL, "Disable CUDA graphs.", "--enforce-eager")),
    "attention_impl": (
        AttentionImplChoice,
        _opt(
            ENGINE_PANEL,
            "Paged attention kernels (auto: Triton on CUDA, native C on the CPU; triton on the "
            "CPU needs TRITON_INTERPRET=1).",
        ),
    ),
    "num_threads": (
        Optional[int],
        _opt(
            ENGINE_PANEL,
            "CPU threads for torch and the C kernels (default: the physical cores this process "
            "may run on, capped by its cgroup CPU quota).",
            "--num-threads",
            "--threads",
            show_default=False,
        ),
    ),
    "seed": (
        int,
        _opt(ENGINE_PANEL, "Engine seed: sampling of requests without their own seed."),
    ),
    "grammar_timeout": (
        float,
        _opt(
            ENGINE_PANEL,
            "Seconds a structured-output grammar may take to compile; slower ones are refused.",
        ),
    ),
    "tensor_parallel_size": (
        int,
        _opt(
            ENGINE_PANEL,
            "Ranks that share each step, one process each (Megatron-style shards). On the CPU "
            "--threads counts per rank; by default each rank takes its share of the cores.",
            "--tensor-parallel-size",
            "-tp",
        ),
    ),
    "numa": (
        bool,
        _opt(
            ENGINE_PANEL,
            "Pin tensor-parallel rank r to NUMA node r (a machine with a node per rank).",
            "--numa/--no-numa",
        ),
    ),
    "kernels": (
        Optional[str],
        _opt(
            ENGINE_PANEL,
            "CPU kernel choices (isa, prefetch, gemm, tiles, int_dots, vnni_q4_k, "
            "small_batches, bf16_gemm, fused_rows, native, layers, timing), e.g. "
            "isa=avx2,gemm=blas; "
            "default: the CPU's own. `bench --json` reports what ran.",
            metavar="NAME=VALUE,...",
            show_default=False,
        ),
    ),
    "speculative_config": (
        Optional[str],
        _opt(
            SPEC_PANEL,
            'Speculative decoding with vLLM\'s keys, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 5}\' (prompt lookup; prompt_lookup_min/max) or '
            '\'{"model": "draft.gguf"}\' (a draft model): the same tokens, faster where '
            "the guesses are right.",
            metavar="JSON",
            show_default=False,
        ),
    ),
}
# EngineConfig fields whose CLI default is None (the option's text, parsed by EngineConfig)
_NONE_DEFAULTS = {"kernels", "speculative_config"}

# llama.cpp's shorthands for the speculative config (not EngineConfig fields: engine_config()
# folds them into speculative_config)
SPEC_SHORTHANDS: dict[str, tuple[Any, typer.models.OptionInfo]] = {
    "spec_type": (
        Optional[str],
        _opt(
            SPEC_PANEL,
            "llama.cpp's spelling: ngram (prompt lookup) or none (-md: a draft model).",
            "--spec-type",
            metavar="ngram|none",
            show_default=False,
        ),
    ),
    "draft_max": (
        Optional[int],
        _opt(SPEC_PANEL, "Most drafts per step (num_speculative_tokens).", show_default=False),
    ),
    "draft_min": (
        Optional[int],
        _opt(
            SPEC_PANEL,
            "Check drafts only where at least this many are proposed.",
            show_default=False,
        ),
    ),
    "model_draft": (
        Optional[str],
        _opt(
            SPEC_PANEL,
            "A draft model with the target's tokenizer (a GGUF, a folder or a hub id): it "
            "guesses the next tokens, the model checks them.",
            "--model-draft",
            "-md",
            metavar="PATH",
            show_default=False,
        ),
    ),
}

# SamplingParams fields that are not CLI defaults: `seed` is per request (the CLI's --seed
# seeds the engine instead).
_SAMPLING_SKIPPED = {"seed"}
SAMPLING_HELP = {
    "n": "Samples per record.",
    "max_tokens": "Most tokens generated per sample.",
    "temperature": "Sampling temperature; 0 is greedy.",
    "top_p": "Nucleus sampling mass, in (0, 1].",
    "top_k": "Keep the k most likely tokens (0: off).",
    "min_p": "Drop tokens below min_p x the top probability.",
    "stop": "A stop string (repeatable).",
    "stop_token_ids": "A stop token id (repeatable).",
    "ignore_eos": "Keep generating past the end-of-sequence token.",
    "repetition_penalty": "Penalty > 1 discourages repeated tokens.",
    "presence_penalty": "Penalty for tokens already present, in [-2, 2].",
    "frequency_penalty": "Penalty per occurrence of a token, in [-2, 2].",
    "skip_special_tokens": "Leave special tokens out of the text.",
    "logprobs": "Report each token's log-probability and the K most likely (0..20).",
    "structured": "A JSON Schema file: every answer is JSON that it validates.",
}
# Defaults of the CLI that differ from SamplingParams' own.
SAMPLING_CLI_DEFAULTS = {"max_tokens": 256, "temperature": 0.7}

VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Show library warnings and full tracebacks.")
]


def _field_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _engine_parameters(overrides: dict[str, Any]) -> list[inspect.Parameter]:
    defaults = {**_field_defaults(EngineConfig), **overrides}
    params = []
    for name, (annotation, option) in ENGINE_OPTIONS.items():
        default = None if name in _NONE_DEFAULTS else defaults[name]
        if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
            default = annotation(default)
        params.append(_keyword(name, Annotated[annotation, option], default))
    for name, (annotation, option) in SPEC_SHORTHANDS.items():
        params.append(_keyword(name, Annotated[annotation, option], None))
    return params


def _sampling_parameters() -> list[inspect.Parameter]:
    defaults = {**_field_defaults(SamplingParams), **SAMPLING_CLI_DEFAULTS}
    annotations = {
        "n": (int, ("--n", "-n")),
        "max_tokens": (int, ()),
        "stop": (Optional[list[str]], ()),
        "stop_token_ids": (Optional[list[int]], ()),
        "ignore_eos": (bool, ("--ignore-eos",)),
        "logprobs": (Optional[int], ()),
        "structured": (Optional[Path], ("--json-schema", "--structured")),
    }
    params = []
    for f in dataclasses.fields(SamplingParams):
        if f.name in _SAMPLING_SKIPPED or f.metadata.get("internal"):
            continue
        annotation, decls = annotations.get(f.name, (type(defaults[f.name]), ()))
        default = defaults[f.name]
        extra: dict[str, Any] = {}
        if isinstance(default, list):
            default, extra = None, {"show_default": False}
        option = typer.Option(
            *decls, help=SAMPLING_HELP[f.name], rich_help_panel=SAMPLING_PANEL, **extra
        )
        params.append(_keyword(f.name, Annotated[annotation, option], default))
    return params


def _keyword(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _inject(func: Callable, injected: list[inspect.Parameter], collect: Callable) -> Callable:
    """Replace the parameter `collect.__name__` of `func` by the injected CLI parameters."""
    target = collect.__name__
    signature = inspect.signature(func, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != target]
    names = {p.name for p in injected}

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        picked = {n: kwargs.pop(n) for n in names}
        return func(**kwargs, **{target: collect(picked)})

    del wrapper.__wrapped__  # Typer must read the new signature, not the original one
    params = sorted(own + injected, key=lambda p: p.kind)
    wrapper.__signature__ = signature.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


def engine_config(values: dict[str, Any]) -> EngineConfig:
    """The EngineConfig of the parsed engine options; a bad value is a CliError (exit 2)."""
    values = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in values.items()}
    values = {k: v for k, v in values.items() if not (k in _NONE_DEFAULTS and v is None)}
    if values.get("chat_template") is not None:
        values["chat_template"] = str(values["chat_template"])
    try:
        _fold_spec_shorthands(values)
        return EngineConfig(**values)
    except ValueError as exc:
        raise CliError(f"invalid engine option: {exc}", exit_code=2) from None


def _fold_spec_shorthands(values: dict[str, Any]) -> None:
    """--spec-type, --draft-max, --draft-min and --model-draft into `speculative_config`:
    --draft-max or --draft-min alone turn prompt lookup on, --model-draft a draft model;
    --spec-type none turns it off."""
    import json

    spec_type = values.pop("spec_type", None)
    draft_max = values.pop("draft_max", None)
    draft_min = values.pop("draft_min", None)
    model_draft = values.pop("model_draft", None)
    text = values.get("speculative_config")
    if spec_type not in (None, "ngram", "none"):
        raise ValueError(f"--spec-type must be ngram or none, got {spec_type!r}")
    given = (text, draft_max, draft_min, model_draft)
    if spec_type == "none":
        if any(value is not None for value in given):
            raise ValueError("--spec-type none turns speculative decoding off; drop the others")
        return
    if spec_type == "ngram" and model_draft is not None:
        raise ValueError("--spec-type ngram and --model-draft are two proposers; pick one")
    if spec_type is None and all(value is None for value in given[1:]):
        return
    spec: dict[str, Any] = {"method": "ngram"}
    if text is not None:
        from pagecli.config import SpeculativeConfig

        spec = dataclasses.asdict(SpeculativeConfig.parse(text))
    if model_draft is not None:
        spec.update(method="draft_model", model=model_draft)
    if draft_max is not None:
        spec["num_speculative_tokens"] = draft_max
    if draft_min is not None:
        spec["draft_min"] = draft_min
    values["speculative_config"] = json.dumps(spec)


def sampling_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """The sampling options as a dict of SamplingParams fields (checked once here)."""
    values = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in values.items()}
    values = {
        k: ([] if v is None and k in ("stop", "stop_token_ids") else v) for k, v in values.items()
    }
    if isinstance(values.get("structured"), Path):
        values["structured"] = {"json_schema": read_json_schema(values["structured"])}
    try:
        SamplingParams(**values)
    except ValueError as exc:
        raise CliError(f"invalid sampling option: {exc}", exit_code=2) from None
    return values


def read_json_schema(path: Path) -> dict[str, Any]:
    """A JSON Schema file's object; a CliError (exit 2) names what is wrong with it."""
    import json

    try:
        schema = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CliError(f"{path}: cannot read the JSON schema ({exc.strerror})", 2) from None
    except ValueError as exc:
        raise CliError(f"{path}: not valid JSON ({exc})", 2) from None
    if not isinstance(schema, dict):
        raise CliError(f"{path}: a JSON schema must be an object", 2)
    return schema


def given_options(ctx: typer.Context, names: Iterable[str]) -> list[str]:
    """The options the user gave (on the command line or in the environment)."""
    given = []
    for name in names:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            given.append(name)
    return given


def engine_options(func: Callable | None = None, /, **defaults: Any) -> Callable:
    """Give a command every engine option; it receives them as `engine_config: EngineConfig`.
    `@engine_options(max_num_seqs=1)`: the command's own defaults for some of them."""
    unknown = set(defaults) - set(ENGINE_OPTIONS)
    if unknown:
        raise TypeError(f"engine_options: not engine options: {sorted(unknown)}")

    def inject(target: Callable) -> Callable:
        return _inject(target, _engine_parameters(defaults), engine_config)

    return inject if func is None else inject(func)


def sampling_options(func: Callable) -> Callable:
    """Give a command every sampling option; it receives `sampling_defaults: dict`."""
    return _inject(func, _sampling_parameters(), sampling_defaults)


_verbose = False


def set_verbose(verbose: bool) -> None:
    """Let library warnings and progress bars through (they are silenced by default)."""
    global _verbose
    _verbose = verbose
    if verbose:
        import warnings

        os.environ["TRANSFORMERS_VERBOSITY"] = "warning"
        os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        warnings.resetwarnings()


def is_verbose() -> bool:
    return _verbose


def load_llm(config: EngineConfig):
    """Load the model once for this process; a bad model is a one-line CliError (exit 2)."""
    from pagecli.errors import ModelLoadError
    from pagecli.llm import LLM

    try:
        return LLM(**dataclasses.asdict(config))
    except Exception as exc:
        if _verbose and not isinstance(exc, (ModelLoadError, ValueError)):
            raise
        raise load_error(config, exc) from None


def load_error(config: EngineConfig, exc: Exception) -> CliError:
    """The one line (exit 2) for an engine that failed to load."""
    from pagecli.errors import ModelLoadError

    if isinstance(exc, ModelLoadError):
        return CliError(str(exc), exit_code=2)
    if isinstance(exc, ValueError):
        return CliError(f"invalid engine option: {_first_line(exc)}", exit_code=2)
    name = config.model or "the default model"
    return CliError(
        f"{name}: cannot load the model ({type(exc).__name__}: {_first_line(exc)})",
        exit_code=2,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""
