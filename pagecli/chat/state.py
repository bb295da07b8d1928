"""The state of `pagecli chat`: named conversations on one LLM, each a ChatSession with its own
sampling parameters, and the JSON files they are saved to and loaded from."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagecli.llm import ChatSession
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import SamplingParams

DATA_DIR_ENV = "PAGECLI_DATA_DIR"
SESSION_FORMAT = "pagecli-chat-session"
SESSION_VERSION = 1
DEFAULT_SESSION = "default"
SESSION_NAME = re.compile(r"[\w][\w.-]*")  # a session's name, also its file name


def turns_text(num_turns: int) -> str:
    return f"{num_turns} turn{'' if num_turns == 1 else 's'}"


class ChatError(Exception):
    """A user-caused problem in a slash command or a session file: shown as one line."""


def data_dir() -> Path:
    """Where chat keeps its history and saved sessions ($PAGECLI_DATA_DIR overrides)."""
    root = os.environ.get(DATA_DIR_ENV)
    if not root:
        import platformdirs

        root = platformdirs.user_data_dir("pagecli")
    return Path(root)


def sessions_dir() -> Path:
    return data_dir() / "sessions"


def session_path(name_or_file: str) -> Path:
    """A session file: a path as given when it names a file or ends in .json, else the saved
    session of that name under the data directory."""
    path = Path(name_or_file).expanduser()
    if path.suffix == ".json" or path.is_file() or os.sep in name_or_file:
        return path
    return sessions_dir() / f"{name_or_file}.json"


@dataclasses.dataclass
class TurnStart:
    """Where a turn began: the number of messages, and of token ids when they are still an
    exact prefix of the session's ids (None after the template forced a re-render)."""

    num_messages: int
    num_token_ids: int | None


class Conversation:
    """A named ChatSession, its sampling parameters, and where each turn began (for /regen)."""

    def __init__(self, session: ChatSession, params: dict[str, Any]) -> None:
        self.session = session
        self.params = _user_fields(SamplingParams(**params))  # every field, checked
        self.turn_starts: list[TurnStart] = []

    @property
    def name(self) -> str:
        return self.session.name

    @property
    def system(self) -> str | None:
        return self.session.system

    @property
    def num_turns(self) -> int:
        return sum(1 for m in self.session.messages if m["role"] == "assistant")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.params)

    def set_param(self, name: str, value: Any) -> None:
        """Change one sampling parameter; a bad value raises ChatError and changes nothing."""
        try:
            checked = SamplingParams(**{**self.params, name: value})
        except ValueError as exc:
            raise ChatError(str(exc)) from None
        # Every field in its asdict form (`structured` as a dict of all its fields), as
        # __init__ stores them: what /save writes and SamplingParams(**params) reads back.
        self.params = _user_fields(checked)

    # ---- turns -----------------------------------------------------------------------------

    def begin_turn(self) -> None:
        self.turn_starts.append(TurnStart(len(self.session.messages), len(self.session.token_ids)))

    def end_turn(self, ids_before: list[int]) -> None:
        """Drop the mark of a turn that recorded nothing; forget token boundaries that a
        re-rendered prompt made stale."""
        start = self.turn_starts[-1]
        if len(self.session.messages) == start.num_messages:
            self.turn_starts.pop()
        elif self.session.token_ids[: len(ids_before)] != ids_before:
            for mark in self.turn_starts:
                mark.num_token_ids = None

    def undo_turn(self) -> str:
        """Forget the last turn and return its user message (for /regen)."""
        if not self.turn_starts:
            raise ChatError("no turn to regenerate in this session")
        start = self.turn_starts.pop()
        user_text = self.session.messages[start.num_messages]["content"]
        del self.session.messages[start.num_messages :]
        if start.num_token_ids is None:
            self.session.token_ids = []  # the next prompt is rendered from the messages
        else:
            del self.session.token_ids[start.num_token_ids :]
        return user_text

    def clear(self) -> None:
        """Forget the conversation; keep the system prompt and the parameters."""
        del self.session.messages[1 if self.system else 0 :]
        self.session.token_ids = []
        self.turn_starts = []

    # ---- files -----------------------------------------------------------------------------

    def to_json(self, model: str) -> dict[str, Any]:
        return {
            "format": SESSION_FORMAT,
            "version": SESSION_VERSION,
            "name": self.name,
            "model": model,
            "system": self.system,
            "messages": self.session.messages,
            "token_ids": self.session.token_ids,
            "turn_starts": [dataclasses.astuple(t) for t in self.turn_starts],
            "parameters": self.params,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    @classmethod
    def from_json(cls, llm: Any, data: Any, model: str, where: str) -> Conversation:
        """Rebuild a saved conversation; token ids are kept only for the same model, and only
        where this process tokenizes (not on an endpoint)."""
        if not isinstance(data, dict) or data.get("format") != SESSION_FORMAT:
            raise ChatError(f"{where}: not a pagecli chat session file")
        try:
            name = str(data["name"])
            system = data.get("system")
            messages = [
                {"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]
            ]
            token_ids = [int(t) for t in data.get("token_ids", [])]
            starts = [
                TurnStart(int(m), None if t is None else int(t))
                for m, t in data.get("turn_starts", [])
            ]
            params = dict(data.get("parameters", {}))
            SamplingParams(**params)  # the same check as /set
        except (KeyError, TypeError, ValueError) as exc:
            raise ChatError(f"{where}: a bad session file ({type(exc).__name__}: {exc})") from None
        session = new_session(llm, system, name)
        session.messages = messages
        if data.get("model") == model and llm.tokenizer is not None:
            session.token_ids = token_ids
        else:
            for start in starts:
                start.num_token_ids = None
        conversation = cls(session, params)
        conversation.turn_starts = starts
        return conversation


class MessagesChatSession(ChatSession):
    """A conversation held as messages only: for a server that tokenizes them itself, so
    there are no token ids to keep (the server's prefix cache does the reuse); `token_ids`
    stays empty."""

    needs_tokenizer = False

    def prompt_ids(self, user_text: str) -> list[int]:
        raise NotImplementedError("a remote session has no token ids")

    def stream(
        self, user_text: str, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        messages = self.messages + [{"role": "user", "content": user_text}]
        last = None
        try:
            for last in self.llm.stream(messages, sampling_params):
                yield last
        finally:
            if last is not None:
                self.messages.append({"role": "user", "content": user_text})
                self.messages.append({"role": "assistant", "content": last.text})


def new_session(llm: Any, system: str | None, name: str) -> ChatSession:
    """Token-exact turns where this process tokenizes (the local engine), messages only on
    an endpoint."""
    if llm.tokenizer is not None:
        return ChatSession(llm, system=system, name=name)
    return MessagesChatSession(llm, system=system, name=name)


class ChatState:
    """Every conversation of one chat process, which one is current, and the model they share.
    `llm` is a SyncBackend (pagecli/backends/sync.py): the local engine or an endpoint."""

    def __init__(
        self, llm: Any, system: str | None, params: dict[str, Any], name: str = DEFAULT_SESSION
    ) -> None:
        self.llm = llm
        self.model_name = llm.model_name
        self.conversations: dict[str, Conversation] = {}
        first = Conversation(new_session(llm, system, name), params)
        self.conversations[name] = self.current = first

    def new(self, name: str | None = None) -> Conversation:
        """Start a conversation with the current one's system prompt and parameters, and make
        it current."""
        if name is None:
            name = self._unused_name()
        if name in self.conversations:
            raise ChatError(f"a session named {name!r} exists (/switch {name} to use it)")
        if not SESSION_NAME.fullmatch(name):
            raise ChatError(f"bad session name {name!r}: use letters, digits, '.', '-' or '_'")
        old = self.current
        session = new_session(self.llm, old.system, name)
        self.conversations[name] = self.current = Conversation(session, old.params)
        return self.current

    def switch(self, name: str) -> Conversation:
        if name not in self.conversations:
            known = ", ".join(self.conversations)
            raise ChatError(f"no session named {name!r} (sessions: {known})")
        self.current = self.conversations[name]
        return self.current

    def set_system(self, system: str | None) -> None:
        """Give the current conversation a new system prompt; its next prompt is rendered
        again from the messages (the old KV cache is reused only where they agree)."""
        old = self.current
        session = new_session(self.llm, system, old.name)
        session.messages += [m for m in old.session.messages if m["role"] != "system"]
        conversation = Conversation(session, old.params)
        conversation.turn_starts = [TurnStart(t.num_messages, None) for t in old.turn_starts]
        shift = len(session.messages) - len(old.session.messages)
        for start in conversation.turn_starts:
            start.num_messages += shift
        self.conversations[old.name] = self.current = conversation

    def save(self, file: str | None = None) -> Path:
        """Write the current conversation as JSON; the default is its name under the data
        directory."""
        path = session_path(file) if file else sessions_dir() / f"{self.current.name}.json"
        data = self.current.to_json(self.model_name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
            tmp.replace(path)
        except OSError as exc:
            raise ChatError(f"{path}: cannot save ({exc.strerror or exc})") from None
        return path

    def load(self, file: str, name: str | None = None) -> Conversation:
        """Read a saved conversation and make it current (replacing one of the same name);
        `name` renames it."""
        path = session_path(file)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ChatError(f"{path}: no such session file") from None
        except OSError as exc:
            raise ChatError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ChatError(f"{path}: not valid JSON ({exc})") from None
        conversation = Conversation.from_json(self.llm, data, self.model_name, str(path))
        if name is not None:
            conversation.session.name = name
        self.conversations[conversation.name] = self.current = conversation
        return conversation

    def _unused_name(self) -> str:
        i = len(self.conversations) + 1
        while f"chat-{i}" in self.conversations:
            i += 1
        return f"chat-{i}"


def _user_fields(params: SamplingParams) -> dict[str, Any]:
    """The parameters in their asdict form, without the internal ones (set by the server)."""
    names = SamplingParams.field_names()
    return {k: v for k, v in dataclasses.asdict(params).items() if k in names}
