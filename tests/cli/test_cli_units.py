"""In-process checks of the CLI's pieces: option names, completions, record parsing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import typer

from pagecli.batch.files import read_resume_state
from pagecli.batch.jsonl import BadLine, Job, id_key, parse_line
from pagecli.batch.progress import ProgressState, progress_text, summary_text
from pagecli.cli.app import app
from pagecli.cli.completions import render_all
from pagecli.config import EngineConfig
from pagecli.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = {"max_tokens": 8, "temperature": 0.0}


def option_names(command: str) -> set[str]:
    cmd = typer.main.get_command(app).commands[command]
    return {p.name for p in cmd.params}


def test_engine_and_sampling_options_map_to_config_fields():
    names = option_names("generate")
    assert EngineConfig.field_names() <= names
    assert SamplingParams.field_names() - {"seed"} <= names  # --seed is the engine's seed
    cmd = typer.main.get_command(app).commands["generate"]
    flags = {o for p in cmd.params for o in p.opts}
    for field in EngineConfig.field_names() | SamplingParams.field_names():
        assert "--" + field.replace("_", "-") in flags


def test_completions_are_up_to_date(tmp_path):
    """Fails when an option changed and `make completions` was not run."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_completions.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    for name in render_all(app):
        fresh = (tmp_path / name).read_text()
        assert (ROOT / "completions" / name).read_text() == fresh, (
            f"run `make completions` ({name})"
        )
    assert "max-tokens" in fresh and "generate" in fresh


def test_bash_completion_completes_options_and_choices():
    script = ROOT / "completions" / "pagecli.bash"
    cmd = (
        f"source {script}; COMP_WORDS=(pagecli generate --dtype bf); COMP_CWORD=3; _pagecli; "
        'echo "${COMPREPLY[@]}"; COMP_WORDS=(pagecli generate --max-tok); COMP_CWORD=2; '
        '_pagecli; echo "${COMPREPLY[@]}"'
    )
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["bfloat16", "--max-tokens"]


def test_parse_line_forms():
    job = parse_line(
        b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n',
        1,
        DEFAULTS,
        system="Be nice.",
    )
    assert isinstance(job, Job) and job.prompt[0] == {"role": "system", "content": "Be nice."}
    assert job.params.max_tokens == 8
    job = parse_line(b'{"prompt": "x", "max_tokens": 3, "stop": "\\n"}', 4, DEFAULTS)
    assert job.id == 4 and job.params.max_tokens == 3 and job.params.stop == ["\n"]
    assert parse_line(b"  \r\n", 2, DEFAULTS) is None
    openai = parse_line(
        json.dumps(
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m", "prompt": "x", "max_completion_tokens": 2},
            }
        ).encode(),
        1,
        DEFAULTS,
    )
    assert openai.api == "completions" and openai.params.max_tokens == 2


def test_parse_line_errors_name_the_field():
    cases = {
        b'{"prompt": "x", "top_p": 2}': "top_p",
        b'{"prompt_token_ids": [1, -2]}': "prompt_token_ids",
        b'{"messages": [{"role": "user"}]}': "messages[0].content",
        b'{"id": true, "prompt": "x"}': "id",
        b'{"prompt": "x", "skip_special_tokens": "yes"}': "skip_special_tokens",
        b'{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "x", "n": 1, '
        b'"tools": []}}': "body.tools",
    }
    for raw, field in cases.items():
        bad = parse_line(raw, 3, DEFAULTS)
        assert isinstance(bad, BadLine) and bad.line == 3 and field in bad.message, bad


def test_ids_compare_as_json_values():
    assert len({id_key(1), id_key("1"), id_key(1.0)}) == 3


def test_resume_state_skips_errors_and_trims_a_torn_line(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(
        '{"id": 1, "error": null}\n{"id": 2, "error": {"message": "x", "line": 2}}\n'
        '{"id": "r", "custom_id": "c", "response": {}, "error": null}\n{"id": 3, "te'
    )
    state = read_resume_state(path)
    assert state.done == {id_key(1), id_key("c")} and state.bad_lines == []
    assert path.read_text().endswith("null}\n")


def test_resume_state_lists_lines_that_are_not_records(tmp_path):
    """They are kept in the file, and an id on such a line is not counted as answered."""
    lines = [
        '{"id": 1, "error": null}',
        "not json {",
        "",
        "[1, 2]",
        '{"id": 2, "prompt": "an input line, not an answer"}',
        '{"id": [3], "error": null}',
        "x" * 100,
        '{"id": 4, "error": null}',
    ]
    path = tmp_path / "out.jsonl"
    path.write_text("\n".join(lines) + "\n")
    state = read_resume_state(path, max_line_bytes=50)
    assert state.done == {id_key(1), id_key(4)}
    assert [line for line, _ in state.bad_lines] == [2, 3, 4, 5, 6, 7]
    assert "JSON" in state.bad_lines[0][1] and "100 bytes" in state.bad_lines[5][1]
    assert path.read_text() == "\n".join(lines) + "\n"


def test_progress_text():
    state = ProgressState(
        done=3,
        total=None,
        errors=1,
        running=2,
        waiting=5,
        decode_tokens_per_s=41.6,
        completion_tokens=90,
        elapsed_s=3.0,
    )
    assert progress_text(state).startswith("3/? records · 1 errors")
    assert "running 2, waiting 5" in progress_text(state)
    assert "30.0 generated tok/s" in summary_text(state)
