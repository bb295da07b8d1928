"""Errors a user can cause, importable without torch or the engine (the CLI names them to
print one line). Each message is that one line."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model cannot be found or read; the message is one line naming the source and why."""
