"""Hybrid models' budgets and options from the command line: a KV budget short of one block
of a windowed model (Gemma 3), one short of a state slot per sequence (Qwen3.5), and a state
snapshot stride that makes no sense each end in one stderr line and exit 2, nothing on
stdout."""

from __future__ import annotations

import pytest

from tests.cli.helpers import TIMEOUT_S, jsonl, start

CASES = {
    "window budget": ("gemma3", ["--kv-cache-memory", "0.000001"], "less than one KV block"),
    "state budget": ("qwen3_5", ["--kv-cache-memory", "0.00001"], "state slot per sequence"),
    "negative stride": ("qwen3_5", ["--state-snapshot-stride", "-1"], "state_snapshot_stride"),
    "stride not a number": ("qwen3_5", ["--state-snapshot-stride", "four"], "stride"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hybrid_budgets_and_strides_are_one_line_exit_2(family_models, case):
    name, args, word = CASES[case]
    proc = start(["generate", "--model", str(family_models[name]), *args])
    out, err = proc.communicate(jsonl({"prompt_token_ids": [5, 6, 7]}), timeout=TIMEOUT_S)
    lines = err.decode().splitlines()
    assert proc.returncode == 2, lines
    assert out == b""
    assert len(lines) == 1 and lines[0].startswith("pagecli: ") and word in lines[0], lines
