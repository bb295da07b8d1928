"""`pagecli generate`: JSONL records in, one JSONL answer per record out, safe in pipes.

This module holds the command and its options; batch/run.py holds the loop.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Optional

import typer

from pagecli.batch.files import DEFAULT_MAX_LINE_BYTES, read_resume_state
from pagecli.batch.run import GenerateRun, RecordWriter, StartFailed
from pagecli.cli.display import generate_progress
from pagecli.cli.endpoint import EndpointSettings, endpoint_options, start_error
from pagecli.cli.options import (
    CliError,
    VerboseOption,
    engine_options,
    sampling_options,
    set_verbose,
)
from pagecli.config import EngineConfig

IO_PANEL = "Input and output"


@engine_options
@sampling_options
@endpoint_options()
def generate(
    *,
    input: Annotated[
        Optional[Path],
        typer.Option(
            "--input",
            "-i",
            help="Read JSONL from FILE (default: stdin).",
            rich_help_panel=IO_PANEL,
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Optional[Path],
        typer.Option(
            "--output",
            "-o",
            help="Write JSONL to FILE (default: stdout).",
            rich_help_panel=IO_PANEL,
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="With -o FILE: skip ids FILE already answers without error, append the rest.",
            rich_help_panel=IO_PANEL,
        ),
    ] = False,
    max_line_bytes: Annotated[
        int,
        typer.Option(
            "--max-line-bytes",
            help="Longest input line; a longer one is skipped unread and answered by an error.",
            rich_help_panel=IO_PANEL,
        ),
    ] = DEFAULT_MAX_LINE_BYTES,
    unordered: Annotated[
        bool,
        typer.Option(
            "--unordered",
            help="Write each record as soon as it finishes, not in input order.",
            rich_help_panel=IO_PANEL,
        ),
    ] = False,
    fail_fast: Annotated[
        bool,
        typer.Option(
            "--fail-fast", help="Stop at the first error record (exit 1).", rich_help_panel=IO_PANEL
        ),
    ] = False,
    progress: Annotated[
        Optional[bool],
        typer.Option(
            "--progress/--no-progress",
            show_default=False,
            rich_help_panel=IO_PANEL,
            help="Progress on stderr (default: when stderr is a terminal).",
        ),
    ] = None,
    display_map: Annotated[
        Optional[bool],
        typer.Option(
            "--display/--no-display",
            show_default=False,
            rich_help_panel=IO_PANEL,
            help="The live KV block map on stderr (default: with progress on a terminal).",
        ),
    ] = None,
    system: Annotated[
        Optional[str],
        typer.Option(
            help="A system message for `messages` records that have none.",
            rich_help_panel="Sampling",
            show_default=False,
        ),
    ] = None,
    max_concurrency: Annotated[
        Optional[int],
        typer.Option(
            "--max-concurrency",
            help="Requests in flight at once (default: 2 x --max-num-seqs locally, 64 on an "
            "endpoint).",
            rich_help_panel=IO_PANEL,
            show_default=False,
        ),
    ] = None,
    verbose: VerboseOption = False,
    sampling_defaults: dict[str, Any],
    engine_config: EngineConfig,
    endpoint: EndpointSettings,
) -> int:
    """Answer JSONL records from stdin (or -i) with JSONL records on stdout (or -o).

    Input records: {"id", "prompt" | "messages" | "prompt_token_ids", sampling fields...}
    or OpenAI batch-API lines (the README has the schema). A record's output constraint is
    `structured`, or OpenAI's `response_format`, or vLLM's `structured_outputs`. With
    --endpoint URL the records run on that OpenAI-compatible server instead of the local
    engine.
    """
    set_verbose(verbose)
    if resume and output is None:
        raise CliError("--resume needs -o FILE (the output of the run to resume)", exit_code=2)
    if max_line_bytes < 1:
        raise CliError(f"--max-line-bytes must be >= 1, got {max_line_bytes}", exit_code=2)
    if max_concurrency is not None and max_concurrency < 1:
        raise CliError(f"--max-concurrency must be >= 1, got {max_concurrency}", exit_code=2)
    backend = endpoint.backend(engine_config)
    done_before: set[str] = set()
    if resume and output.is_file():
        done_before = _read_previous_run(output, max_line_bytes)
    source = _open_input(input)
    out_fd = _open_output(output, append=resume)
    show = progress if progress is not None else sys.stderr.isatty()
    display = generate_progress(show, False if endpoint.remote else display_map)
    run = GenerateRun(
        backend,
        RecordWriter(out_fd),
        display,
        sampling_defaults,
        system=system,
        ordered=not unordered,
        fail_fast=fail_fast,
        done_before=done_before,
        max_line_bytes=max_line_bytes,
        max_concurrency=max_concurrency,
        loading_name=endpoint.urls[0]
        if endpoint.remote
        else (engine_config.model or "the default model"),
        terminal_note=input is None and sys.stdin.isatty(),
    )
    try:
        code = run.run(source)
    except StartFailed as exc:  # a bad model, URL, key or server, before any line is read
        raise start_error(backend, engine_config, exc.error) from None
    if run.reading:
        # The reader thread is blocked on an open pipe; a normal interpreter shutdown could
        # trip over its lock on the input. Everything is written: leave now.
        sys.stderr.flush()
        os._exit(code)
    return code


def _read_previous_run(path: Path, max_line_bytes: int) -> set[str]:
    """The ids `path` already answers; one warning per line of it that is not a record (kept
    in the file, and answering no id)."""
    try:
        state = read_resume_state(path, max_line_bytes)
    except OSError as exc:
        raise CliError(
            f"{path}: cannot read output to resume ({exc.strerror})", exit_code=2
        ) from None
    for line, why in state.bad_lines:
        print(
            f"pagecli: {path}:{line}: not a record ({why}); kept, its id is not counted as done",
            file=sys.stderr,
        )
    return state.done


def _open_input(path: Path | None) -> BinaryIO:
    if path is None:  # a file object of our own: the reader thread may block in it
        return open(sys.stdin.fileno(), "rb", closefd=False)
    try:
        return path.open("rb")
    except OSError as exc:
        raise CliError(f"{path}: cannot read input ({exc.strerror})", exit_code=2) from None


def _open_output(path: Path | None, append: bool) -> int:
    if path is None:
        return sys.stdout.fileno()
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
    try:
        return os.open(path, flags, 0o644)
    except OSError as exc:
        raise CliError(f"{path}: cannot write output ({exc.strerror})", exit_code=2) from None
