"""Start-up cost: help and a remote server's client never load torch or transformers, and a
GGUF run never imports transformers (its tokenizer and config come from the converted folder
without it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli.helpers import FAST, env, jsonl, records, run

HEAVY = ("torch", "transformers")

# Runs the Typer app in this interpreter, then reports which heavy modules it imported.
_PROBE = """
import json, sys
from pagecli.cli.entry import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}))
"""


def _imports(*args: str) -> dict:
    probe = _PROBE % (HEAVY,)
    out = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env(), timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["--version"],
        ["generate", "--help"],
        ["chat", "--help"],
        ["bench", "--help"],
        ["serve", "--help"],
        ["blocks", "--help"],
    ],
)
def test_help_imports_neither_torch_nor_transformers(args):
    result = _imports(*args)
    assert result["code"] in (0, None)
    assert result["loaded"] == [], f"{' '.join(args)} imported {result['loaded']}"


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_a_client_of_a_remote_server_imports_neither(command):
    """With --endpoint the local engine never runs, so its torch is never imported (1.5 s of
    a client's start); an unreachable server ends the run in its one line, exit 2."""
    result = _imports(command, "--endpoint", "http://127.0.0.1:1/v1")
    assert result["code"] == 2
    assert result["loaded"] == [], f"{command} --endpoint imported {result['loaded']}"


def test_gguf_generate_runs_without_transformers():
    """The default model (a GGUF, converted once beforehand) answers a record with
    transformers never imported: the `-X importtime` trace of the real process names none."""
    from pagecli.loader.resolve import resolve_model

    resolve_model(None)  # the one-time conversion is transformers' work, not this run's
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pagecli.cli.entry", "generate", *FAST],
        input=jsonl({"id": 1, "prompt": "hi"}),
        capture_output=True,
        env=env(),
        timeout=180,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.decode().splitlines()]
    assert "torch" in imported  # the trace is there
    assert not [m for m in imported if m == "transformers" or m.startswith("transformers.")]
    assert records(out.stdout)[0]["error"] is None


def test_entry_point_help_exits_zero():
    out = run(["--help"])
    assert out.returncode == 0 and b"generate" in out.stdout
