"""Workload sizes of the slower tests: `make test` runs the CI size, which keeps the suite
under 15 minutes on 2 cores (two workers: docs/testing.md); `PAGECLI_FULL_TESTS=1` runs the
larger size each test names (more prompts, longer replies, more rounds). The checks are the
same at both sizes."""

from __future__ import annotations

import os

FULL = os.environ.get("PAGECLI_FULL_TESTS") == "1"


def size(ci: int, full: int) -> int:
    """`ci` in `make test`, `full` under PAGECLI_FULL_TESTS=1."""
    return full if FULL else ci
