"""The slash commands of `pagecli chat`: a table of name -> (usage, help, handler).

Handlers take the Chat and the text after the command; a user mistake raises ChatError (one
line, never a traceback). A handler returns False to end the chat.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

from pagecli.chat.state import ChatError, ChatState, turns_text
from pagecli.cli.options import CliError, read_json_schema
from pagecli.sampling_params import SamplingParams, StructuredOutputs


class Chat(Protocol):
    """What the commands and the terminal use of a chat (pagecli.chat.console.Chat is one): named
    here so that neither imports the command-line shell."""

    state: ChatState
    console: Any  # rich.console.Console, on stderr
    last_stats: Any  # the last turn's turn.TurnStats, or None

    def info(self, text: str, style: Optional[str] = None, markup: bool = False) -> None: ...

    def show(self, renderable: Any) -> None: ...

    def reply(self, text: str) -> None: ...

    def handle(self, message: str) -> bool: ...


KEYS_HELP = (
    'Keys: Esc Enter adds a line; """ starts a multi-line block that """ ends; '
    "Ctrl-C stops a reply, clears the line, or exits on an empty line; Ctrl-D exits.\n"
    "A message that starts with / is sent as a command; start it with // to send it as text."
)
# Sampling parameters /set may change (chat shows one sample per turn, so not `n`); the
# output constraint (`structured`) is set through `format` and `schema` instead.
SAMPLING_SETTABLE = [
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name not in ("n", "structured") and not f.metadata.get("internal")
]
CONSTRAINT_SETTABLE = {"format": "json|text", "schema": "FILE|off"}
SETTABLE = [*SAMPLING_SETTABLE, *CONSTRAINT_SETTABLE]  # every name /set takes
_NULLABLE = {"max_tokens", "seed"}
NOT_WITH_ENDPOINT = "not available with --endpoint (it needs the local engine)"
_TRUE, _FALSE = {"true", "on", "yes", "1"}, {"false", "off", "no", "0"}


@dataclass(frozen=True)
class Command:
    usage: str  # the arguments, as shown by /help
    help: str
    run: Callable[[Chat, str], Any]


def run_command(chat: Chat, line: str) -> bool:
    """Run one slash command line; False means the chat should end."""
    name, _, arg = line.strip().partition(" ")
    command = COMMANDS.get(ALIASES.get(name.lower(), name.lower()))
    if command is None:
        close = difflib.get_close_matches(name.lower(), COMMANDS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ChatError(f"unknown command {name} ({hint}/help lists them)")
    return command.run(chat, arg.strip()) is not False


def parse_param(name: str, text: str) -> Any:
    """The value of sampling parameter `name` from its /set text."""
    if name == "structured":
        raise ChatError("set the output constraint with /set format json|text or /set schema FILE")
    if name not in SAMPLING_SETTABLE:
        close = difflib.get_close_matches(name, SETTABLE, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ChatError(f"unknown parameter {name!r}{hint}; settable: {', '.join(SETTABLE)}")
    if not text:
        raise ChatError(f"usage: /set {name} VALUE")
    default = getattr(SamplingParams(), name)
    lowered = text.lower()
    try:
        if name in _NULLABLE and lowered in ("none", "null", "off"):
            return None
        if isinstance(default, bool):
            if lowered not in _TRUE | _FALSE:
                raise ValueError
            return lowered in _TRUE
        if name == "stop":
            if lowered in ("none", "[]"):
                return []
            value = json.loads(text) if text[0] in '["' else text
            return [value] if isinstance(value, str) else [str(v) for v in value]
        if name == "stop_token_ids":
            return (
                []
                if lowered in ("none", "[]")
                else [int(t) for t in text.replace(",", " ").split()]
            )
        if isinstance(default, float):
            return float(text)
        return int(text)
    except ValueError:
        raise ChatError(f"bad value for {name}: {text!r}") from None


def parse_constraint(name: str, text: str) -> dict[str, Any] | None:
    """The `structured` value of `/set format json|text` or `/set schema FILE|off`."""
    lowered = text.lower()
    if name == "format":
        if lowered not in ("json", "text"):
            raise ChatError("usage: /set format json|text (any JSON object, or free text)")
        return {"json_object": True} if lowered == "json" else None
    if not text:
        raise ChatError("usage: /set schema FILE|off (a JSON schema file, or none)")
    if lowered in ("off", "none"):
        return None
    try:
        return {"json_schema": read_json_schema(Path(text).expanduser())}
    except CliError as exc:
        raise ChatError(str(exc)) from None


def constraint_text(structured: Any) -> str:
    """One line for a session's output constraint (its `structured` parameter)."""
    if structured is None:
        return "none (free text)"
    spec = StructuredOutputs.coerce(structured)
    if spec.json_object:
        text = "any JSON object"
    elif spec.json_schema is not None:
        schema = json.dumps(spec.json_schema, ensure_ascii=False)
        text = f"JSON schema {schema if len(schema) <= 60 else schema[:59] + '…'}"
    elif spec.regex is not None:
        text = f"regex {spec.regex!r}"
    elif spec.choice is not None:
        text = f"one of {', '.join(map(repr, spec.choice))}"
    else:
        text = f"grammar of {len(spec.grammar.splitlines())} lines"
    return text + (", compact whitespace" if spec.whitespace == "compact" else "")


# ---- handlers ------------------------------------------------------------------------------


def _help(chat: Chat, arg: str) -> None:
    width = max(len(f"{n} {c.usage}") for n, c in COMMANDS.items())
    for name, command in COMMANDS.items():
        chat.info(f"  {f'{name} {command.usage}'.ljust(width)}  {command.help}")
    chat.info(KEYS_HELP)


def _system(chat: Chat, arg: str) -> None:
    if not arg:
        system = chat.state.current.system
        chat.info(system if system else "(no system prompt: the model's template default)")
        return
    chat.state.set_system(arg)
    chat.info(f"system prompt of {chat.state.current.name!r} set; /new sessions use it too")


def _new(chat: Chat, arg: str) -> None:
    conversation = chat.state.new(arg or None)
    chat.info(f"new session {conversation.name!r} (the same system prompt and parameters)")


def _sessions(chat: Chat, arg: str) -> None:
    width = max(len(name) for name in chat.state.conversations)
    for name, conversation in chat.state.conversations.items():
        mark = "*" if conversation is chat.state.current else " "
        system = conversation.system or "(default)"
        if len(system) > 40:
            system = system[:39] + "…"
        chat.info(
            f"{mark} {name.ljust(width)}  {turns_text(conversation.num_turns)}, "
            f"{len(conversation.session.token_ids)} tokens, system: {system}"
        )


def _switch(chat: Chat, arg: str) -> None:
    if not arg:
        raise ChatError("usage: /switch NAME (/sessions lists them)")
    conversation = chat.state.switch(arg)
    chat.info(f"switched to {conversation.name!r} ({turns_text(conversation.num_turns)})")


def _set(chat: Chat, arg: str) -> None:
    name, _, text = arg.partition(" ")
    if not name:
        raise ChatError("usage: /set PARAM VALUE (/params shows them)")
    conversation = chat.state.current
    if name in CONSTRAINT_SETTABLE:
        structured = parse_constraint(name, text.strip())
        check_compiles(chat.state.llm, structured)
        conversation.set_param("structured", structured)
        chat.info(f"structured = {constraint_text(conversation.params['structured'])}")
        return
    conversation.set_param(name, parse_param(name, text.strip()))
    chat.info(f"{name} = {conversation.params[name]!r}")


def check_compiles(llm: Any, structured: Any) -> None:
    """Refuse a constraint the local engine cannot compile now, not at the next turn (the
    compiled grammar is cached for it); a server judges it when the turn is sent. `llm` is
    the chat's SyncBackend."""
    engine = llm.engine
    if structured is None or engine is None:
        return
    from pagecli.errors import RequestError

    try:
        engine.compile_grammar(StructuredOutputs.coerce(structured))
    except (RequestError, ValueError) as exc:
        raise ChatError(f"the engine refuses this constraint: {exc}") from None


def _params(chat: Chat, arg: str) -> None:
    params = chat.state.current.params
    for name in SAMPLING_SETTABLE:
        chat.info(f"  {name} = {params.get(name)!r}")
    chat.info(f"  structured = {constraint_text(params.get('structured'))}")


def _stats(chat: Chat, arg: str) -> None:
    from pagecli.cli.display import stats_table

    conversation = chat.state.current
    tokens = f", {len(conversation.session.token_ids)} tokens" if chat.state.llm.is_local else ""
    chat.info(f"session {conversation.name!r}: {turns_text(conversation.num_turns)}{tokens}")
    if chat.last_stats is not None:
        chat.info(f"last turn: {chat.last_stats.line()}")
    stats = chat.state.llm.stats()
    if stats is None:
        chat.info(f"engine numbers: {NOT_WITH_ENDPOINT}", style="dim")
    else:
        chat.show(stats_table(stats))
        choice = chat.state.llm.engine.runner.thread_choice
        chat.info(f"threads: {choice.num_threads}, {choice.reason}")
        if stats.tensor_parallel_size > 1:
            chat.info(
                f"tensor parallel: {stats.tensor_parallel_size} ranks, "
                f"{stats.tp_comm_s:.2f} s in collectives"
            )
        chat.info(f"memory: {chat.state.llm.engine.runner.memory.line()}")
        if stats.spec_drafts:
            chat.info(
                f"speculative decoding: {stats.spec_draft_tokens} drafts checked, "
                f"{stats.spec_acceptance_rate:.0%} accepted, "
                f"{stats.spec_mean_accepted_length:.2f} tokens a step"
            )
        chat.info("kernels: " + ", ".join(f"{k} {v}" for k, v in stats.kernels.items()))


def _blocks(chat: Chat, arg: str) -> None:
    from pagecli.cli.display import map_width_for, render

    stats = chat.state.llm.stats()
    if stats is None:
        raise ChatError(f"/blocks: {NOT_WITH_ENDPOINT}")
    chat.show(render(stats, map_width_for(chat.console)))


def _prompt(chat: Chat, arg: str) -> None:
    session = chat.state.current.session
    tokenizer = chat.state.llm.tokenizer
    if tokenizer is None:
        raise ChatError(f"/prompt: {NOT_WITH_ENDPOINT} (the server tokenizes the messages)")
    num_warnings = len(session.warnings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = session.prompt_ids(arg)
    del session.warnings[num_warnings:]  # a dry run: the real turn will warn if it must
    chat.info(tokenizer.decode(ids, skip_special_tokens=False), markup=False)
    kept = len(session.token_ids)
    chat.info(
        f"{len(ids)} tokens ({kept} kept from the conversation so far"
        f"{'' if arg else ', and an empty user message: /prompt TEXT shows TEXT'})"
    )


def _save(chat: Chat, arg: str) -> None:
    path = chat.state.save(arg or None)
    chat.info(f"saved session {chat.state.current.name!r} to {path}")


def _load(chat: Chat, arg: str) -> None:
    if not arg:
        raise ChatError("usage: /load FILE (or the NAME of a session saved with /save)")
    conversation = chat.state.load(arg)
    kept = len(conversation.session.token_ids)
    how = f"{kept} token ids kept" if kept else "the next prompt is rendered from the messages"
    chat.info(f"loaded session {conversation.name!r}: {turns_text(conversation.num_turns)} ({how})")


def _clear(chat: Chat, arg: str) -> None:
    chat.state.current.clear()
    chat.info(f"cleared session {chat.state.current.name!r}")


def _regen(chat: Chat, arg: str) -> None:
    chat.reply(chat.state.current.undo_turn())


def _exit(chat: Chat, arg: str) -> bool:
    return False


COMMANDS: dict[str, Command] = {
    "/help": Command("", "this list", _help),
    "/system": Command("[TEXT]", "show or set the system prompt", _system),
    "/new": Command("[NAME]", "a new session with the current system prompt", _new),
    "/sessions": Command("", "list the sessions", _sessions),
    "/switch": Command("NAME", "make another session current", _switch),
    "/set": Command(
        "PARAM VALUE",
        "change a sampling parameter of this session (format json|text and schema "
        "FILE|off constrain its replies)",
        _set,
    ),
    "/params": Command("", "show this session's sampling parameters and constraint", _params),
    "/stats": Command("", "the last turn and the engine's numbers", _stats),
    "/blocks": Command("", "the KV block map", _blocks),
    "/prompt": Command("[TEXT]", "the exact prompt of the next turn and its token count", _prompt),
    "/save": Command("[FILE]", "save this session as JSON (default: by name)", _save),
    "/load": Command("FILE|NAME", "load a saved session and continue it", _load),
    "/clear": Command("", "forget this session's conversation", _clear),
    "/regen": Command("", "generate the last reply again", _regen),
    "/exit": Command("", "leave (so do Ctrl-D and Ctrl-C on an empty line)", _exit),
}
ALIASES = {"/quit": "/exit", "/bye": "/exit", "/?": "/help"}
