"""Chat: one chat process's sessions, where replies and messages go, and the glue of one
turn, shared by the terminal REPL (repl.py) and the piped mode (`run_piped`). Replies go to
stdout, token by token; everything else (stats lines, command output, errors) to stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional, TextIO

from rich.console import Console, RenderableType

from pagecli.chat.commands import run_command
from pagecli.chat.framing import messages
from pagecli.chat.state import ChatError, ChatState

if TYPE_CHECKING:  # turn.py imports the engine (torch): loaded with the first turn
    from pagecli.chat.turn import TurnStats


class Chat:
    """One chat process: the sessions, where replies and messages go, and one turn's glue."""

    def __init__(
        self,
        state: ChatState,
        stdout: Optional[TextIO] = None,
        stderr: Optional[TextIO] = None,
        interactive: bool = True,
        autosave: Optional[str] = None,
    ) -> None:
        self.state = state
        self.stdout = stdout or sys.stdout
        self.console = Console(file=stderr or sys.stderr, highlight=False, soft_wrap=True)
        self.interactive = interactive
        self.autosave = autosave  # the session saved after each of its turns (--session)
        self.last_stats: Optional[TurnStats] = None
        self.num_errors = 0

    def info(self, text: str, style: Optional[str] = None, markup: bool = False) -> None:
        self.console.print(text, style=style, markup=markup)

    def show(self, renderable: RenderableType) -> None:
        self.console.print(renderable)

    def error(self, text: str) -> None:
        self.num_errors += 1
        self.console.print(f"error: {text}", style="red", markup=False)

    def handle(self, message: str) -> bool:
        """A user message or a slash command; False when the chat should end."""
        try:
            if message.startswith("/") and not message.startswith("//"):
                return run_command(self, message)
            self.reply(message[1:] if message.startswith("//") else message)
        except ChatError as exc:
            self.error(str(exc))
        return True

    def reply(self, text: str) -> None:
        """One turn: the reply streams to stdout, then one dim stats line on stderr."""
        from pagecli.chat.turn import run_turn

        conversation = self.state.current

        def write(delta: str) -> None:
            self.stdout.write(delta)
            self.stdout.flush()

        num_warnings = len(conversation.session.warnings)
        try:
            stats = run_turn(conversation, text, write, stoppable=self.interactive)
        finally:
            write("\n")
        for warning in conversation.session.warnings[num_warnings:]:
            self.info(f"note: {warning}", style="dim")
        self.last_stats = stats
        if stats is None:
            self.info("stopped before the first token", style="dim")
        else:
            self.info(stats.line(), style="dim")
        if self.autosave is not None and conversation.name == self.autosave:
            self.state.save()


def run_piped(chat: Chat, lines: Iterable[str]) -> int:
    """The non-terminal mode: each message gets its reply and a newline on stdout."""
    for message in messages(lines):
        if not chat.handle(message):
            break
    return 1 if chat.num_errors else 0
