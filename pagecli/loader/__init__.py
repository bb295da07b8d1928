"""Resolve a model source (local folder, .gguf file, hub id, preset) and load its weights."""

from pagecli.loader.resolve import ModelLoadError, ModelSource, resolve_model

__all__ = ["ModelLoadError", "ModelSource", "resolve_model"]
