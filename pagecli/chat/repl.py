"""The terminal side of `pagecli chat`: a prompt-toolkit session with persistent history,
multi-line input, slash-command completion and a bottom toolbar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent
from prompt_toolkit.output import Output

from pagecli.chat.commands import COMMANDS, SETTABLE
from pagecli.chat.framing import is_closed_block, unfence
from pagecli.chat.state import data_dir, sessions_dir, turns_text

if TYPE_CHECKING:
    from pagecli.chat.commands import Chat

PROMPT = ">>> "
CONTINUATION = "... "
PLACEHOLDER = "Send a message (/help for commands, Ctrl-D to exit)"


def key_bindings() -> KeyBindings:
    """Enter sends (inside an open triple-quoted block it adds a line); Esc Enter adds a line;
    Ctrl-C clears a non-empty line and exits on an empty one."""
    bindings = KeyBindings()

    @bindings.add("enter")
    def _enter(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if buffer.complete_state is not None and buffer.complete_state.current_completion:
            buffer.apply_completion(buffer.complete_state.current_completion)
        elif is_closed_block(buffer.text):
            buffer.validate_and_handle()
        else:
            buffer.insert_text("\n")

    @bindings.add("escape", "enter")
    def _newline(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    @bindings.add("c-c")
    def _interrupt(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        if buffer.text:
            buffer.reset()
        else:
            event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

    return bindings


class SlashCompleter(Completer):
    """Completes command names, /set's parameters, /switch's sessions and /load's files."""

    def __init__(self, chat: Chat) -> None:
        self.chat = chat
        self.paths = PathCompleter(expanduser=True)

    def get_completions(
        self, document: Document, complete_event: CompleteEvent
    ) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        if " " not in text:
            for name, command in COMMANDS.items():
                if name.startswith(text.lower()):
                    yield Completion(name, -len(text), display_meta=command.help)
            return
        name, _, arg = text.partition(" ")
        if name == "/set" and " " not in arg:
            choices = SETTABLE
        elif name == "/switch":
            choices = list(self.chat.state.conversations)
        elif name == "/load":
            saved = sessions_dir()
            choices = sorted(p.stem for p in saved.glob("*.json")) if saved.is_dir() else []
            yield from self.paths.get_completions(Document(arg), complete_event)
        else:
            return
        for choice in choices:
            if choice.startswith(arg):
                yield Completion(choice, -len(arg))


def toolbar_text(chat: Chat) -> str:
    """model, dtype │ session, turns, tokens │ KV blocks in use / total, shared, cached."""
    state = chat.state
    conversation = state.current
    stats = state.llm.stats()
    if stats is None:  # a server: no engine here to show
        return (
            f" {state.model_name} · {state.llm.backend.name} │ session {conversation.name}: "
            f"{turns_text(conversation.num_turns)} │ /help "
        )
    return (
        f" {state.model_name} · {state.llm.engine.dtype_choice.name} │ session "
        f"{conversation.name}: {turns_text(conversation.num_turns)}, "
        f"{len(conversation.session.token_ids)} tokens │ KV blocks {stats.blocks_in_use}"
        f"/{stats.num_blocks} in use, {stats.blocks_shared} shared, "
        f"{stats.blocks_cached_free} cached │ /help "
    )


def history() -> History:
    """The input history file under the data directory (in memory when it cannot be made)."""
    path = data_dir() / "history"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        return InMemoryHistory()
    return FileHistory(str(path))


class Repl:
    """Read a message or a command, answer it, repeat until Ctrl-D, Ctrl-C on an empty line
    or /exit."""

    def __init__(
        self, chat: Chat, input: Optional[Input] = None, output: Optional[Output] = None
    ) -> None:
        self.chat = chat
        self._toolbar = ""
        if output is None:
            from prompt_toolkit.output import create_output

            output = create_output(always_prefer_tty=True)  # stdout may be a file
        self.session: PromptSession[str] = PromptSession(
            history=history(),
            completer=SlashCompleter(chat),
            complete_while_typing=True,
            key_bindings=key_bindings(),
            multiline=True,
            prompt_continuation=CONTINUATION,
            bottom_toolbar=lambda: self._toolbar,
            placeholder=PLACEHOLDER,
            input=input,
            output=output,
        )

    def run(self) -> int:
        chat = self.chat
        engine = chat.state.llm.engine
        where = engine.dtype_choice.reason if engine is not None else chat.state.llm.backend.name
        chat.info(
            f"pagecli chat · {chat.state.model_name} · {where} · /help lists commands · "
            "Esc Enter adds a line · Ctrl-D exits",
            style="dim",
        )
        while True:
            self._toolbar = toolbar_text(chat)  # the engine is idle while the user types
            try:
                text = self.session.prompt(PROMPT)
            except (KeyboardInterrupt, EOFError):
                return 0
            message = unfence(text)
            if not message:
                continue
            try:
                if not chat.handle(message):
                    return 0
            except KeyboardInterrupt:  # a second Ctrl-C, outside the reply's own handling
                chat.info("interrupted", style="dim")
