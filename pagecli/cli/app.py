"""The `pagecli` Typer app and `main()`, the console script: commands are registered here,
and every failure a user can cause ends as one `pagecli: ` line on stderr."""

from __future__ import annotations

import atexit
import os
import sys
import traceback
import warnings
from typing import Annotated, Optional

import typer
from typer._click import exceptions as click_exceptions  # Typer >= 0.24 vendors click

from pagecli import __version__
from pagecli.cli.bench import bench
from pagecli.cli.blocks import blocks
from pagecli.cli.chat import chat
from pagecli.cli.generate import generate
from pagecli.cli.options import CliError, is_verbose
from pagecli.cli.serve import serve

app = typer.Typer(
    name="pagecli",
    help="Run open-weight LLMs in your terminal on a paged-KV-cache engine.",
    no_args_is_help=True,
    add_completion=False,  # completions/ ships static scripts (no Python start per Tab)
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        print(f"pagecli {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = None,
) -> None:
    """Run open-weight LLMs in your terminal on a paged-KV-cache engine."""


app.command("generate")(generate)
app.command("bench")(bench)
app.command("blocks")(blocks)
app.command("chat")(chat)
app.command("serve")(serve)


def main(argv: list[str] | None = None) -> None:
    """The console script: run the app, turn user errors into one line and an exit code."""
    command = typer.main.get_command(app)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # `--verbose` lets them through again
            code = command.main(args=argv, prog_name="pagecli", standalone_mode=False)
    except click_exceptions.NoArgsIsHelpError as exc:
        if exc.format_message():  # the rich help printer has already written it
            print(exc.format_message())
        code = 0
    except click_exceptions.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "pagecli"
        _fail(f"{exc.format_message()} (see '{where} --help')", exc.exit_code)
    except click_exceptions.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except typer.Abort:
        _fail("aborted", 130)
    except CliError as exc:
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _leave(130)
    except Exception as exc:
        if is_verbose():
            traceback.print_exc()
        text = str(exc).strip().splitlines()
        _fail(
            f"internal error: {type(exc).__name__}: {text[0] if text else ''} "
            "(--verbose shows the traceback)",
            1,
        )
    code = code if isinstance(code, int) else 0
    if code:  # a command that ends itself on a failure or a Ctrl-C (generate's 130)
        _leave(code)
    sys.exit(0)


def _fail(message: str, code: int) -> None:
    print(f"pagecli: {message}", file=sys.stderr)
    _leave(code)


def _leave(code: int) -> None:
    """Exit with `code` after a failure or a Ctrl-C. The engine's thread (a daemon) may still be
    at work then, building the model or running steps; CPython's shutdown ends such a thread
    with pthread_exit where it next takes the GIL, and inside torch's C++ that unwinding aborts
    the process ("terminate called without an active exception", SIGABRT instead of the
    code). So, while it is at work, the exit handlers run here (tensor-parallel workers
    stopped, temporary files removed), the streams are flushed, and the process leaves without
    the interpreter's shutdown."""
    engines = sys.modules.get("pagecli.engine.async_engine")  # not imported: no engine
    if engines is None or not engines.engine_at_work():
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to write there
            pass
    os._exit(code)
