"""`pagecli chat`: an interactive chat on a terminal (prompt-toolkit REPL, chat/repl.py), or a
scripted one when stdin is not a terminal: one user message per line, one reply per line.

Replies go to stdout, token by token; everything else (stats lines, command output, errors)
goes to stderr. Several sessions live in one engine, so those with the same system prompt share
its KV blocks, and every turn reuses the KV of the conversation so far.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from pagecli.backends.sync import SyncBackend
from pagecli.chat.commands import check_compiles
from pagecli.chat.console import Chat, run_piped
from pagecli.chat.state import SESSION_NAME, ChatError, ChatState, sessions_dir
from pagecli.cli.endpoint import EndpointSettings, endpoint_options, start_error
from pagecli.cli.options import (
    CliError,
    VerboseOption,
    engine_options,
    given_options,
    sampling_options,
    set_verbose,
)
from pagecli.config import EngineConfig

CHAT_PANEL = "Chat"
BROKEN_PIPE_EXIT_CODE = 141  # what a tool killed by SIGPIPE reports


def _read_system(system: Optional[str], system_file: Optional[Path]) -> Optional[str]:
    if system is not None and system_file is not None:
        raise CliError("give --system or --system-file, not both", exit_code=2)
    if system_file is None:
        return system
    try:
        return system_file.read_text().strip() or None
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise CliError(f"{system_file}: cannot read the system prompt ({reason})", 2) from None


# one conversation, one sequence at a time: the integer kernels at every batch
# (engine/spec_decode/invariance.py)
@engine_options(max_num_seqs=1)
@sampling_options
@endpoint_options()
def chat(
    ctx: typer.Context,
    *,
    system: Annotated[
        Optional[str],
        typer.Option(
            "--system",
            "-s",
            help="The system prompt.",
            rich_help_panel=CHAT_PANEL,
            show_default=False,
        ),
    ] = None,
    system_file: Annotated[
        Optional[Path],
        typer.Option(
            "--system-file",
            help="Read the system prompt from FILE.",
            rich_help_panel=CHAT_PANEL,
            dir_okay=False,
            show_default=False,
        ),
    ] = None,
    session: Annotated[
        Optional[str],
        typer.Option(
            "--session",
            help="Continue the session saved as NAME (or start it); it is "
            "saved again after every turn.",
            rich_help_panel=CHAT_PANEL,
            show_default=False,
        ),
    ] = None,
    verbose: VerboseOption = False,
    sampling_defaults: dict[str, Any],
    engine_config: EngineConfig,
    endpoint: EndpointSettings,
) -> int:
    """Chat with a model: streaming replies, sessions that share their system prompt's KV.

    On a terminal: /help lists the commands, Esc Enter adds a line, Ctrl-C stops a reply,
    Ctrl-D exits. With stdin from a pipe: one message per line, one reply per line on stdout.
    With --endpoint URL the replies come from that OpenAI-compatible server.
    """
    set_verbose(verbose)
    system = _read_system(system, system_file)
    if sampling_defaults.pop("n", 1) != 1:
        raise CliError("chat shows one sample per turn: --n must be 1", exit_code=2)
    if session is not None and not SESSION_NAME.fullmatch(session):
        raise CliError(
            f"--session takes a name (letters, digits, '.', '-', '_'), got {session!r}; "
            "/load FILE reads a session file",
            exit_code=2,
        )
    interactive = sys.stdin.isatty()
    backend = SyncBackend(endpoint.backend(engine_config))
    try:
        _start(backend, engine_config, endpoint, interactive)
        return _run(backend, ctx, system, session, sampling_defaults, interactive)
    finally:
        backend.close()


def _start(
    backend: SyncBackend, engine_config: EngineConfig, endpoint: EndpointSettings, interactive: bool
) -> None:
    """Load the model or connect to the server; one line (exit 2) when that fails."""
    console = Console(stderr=True)
    what = (
        f"connecting to {endpoint.urls[0]}"
        if endpoint.remote
        else f"loading {engine_config.model or 'the default model'}"
    )
    try:
        if interactive and console.is_terminal:
            with console.status(f"{what}…"):
                backend.start()
        else:
            backend.start()
    except (CliError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise start_error(backend.backend, engine_config, exc) from None
    if backend.is_local and backend.tokenizer is None:
        name = backend.model_name
        raise CliError(f"{name} has no tokenizer: chat needs one", exit_code=2)


def _run(
    backend: SyncBackend,
    ctx: typer.Context,
    system: Optional[str],
    session: Optional[str],
    sampling_defaults: dict[str, Any],
    interactive: bool,
) -> int:
    try:
        check_compiles(backend, sampling_defaults.get("structured"))
    except ChatError as exc:
        raise CliError(f"--json-schema: {exc}", exit_code=2) from None
    state = ChatState(backend, system, sampling_defaults, name=session or "default")
    saved = sessions_dir() / f"{session}.json"
    if session is not None and saved.is_file():
        try:
            state.load(str(saved), name=session)
        except ChatError as exc:
            raise CliError(str(exc), exit_code=2) from None
        if system is not None and system != state.current.system:
            state.set_system(system)
        for name in given_options(ctx, sampling_defaults):
            state.current.set_param(name, sampling_defaults[name])
    chat = Chat(state, interactive=interactive, autosave=session)
    if not interactive:
        try:
            return run_piped(chat, sys.stdin)
        except BrokenPipeError:
            # The reader went away (`| head -1`): stop quietly, as a tool killed by SIGPIPE.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return BROKEN_PIPE_EXIT_CODE
    from pagecli.chat.repl import Repl

    return Repl(chat).run()
