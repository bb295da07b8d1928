"""What every tool-call format shares: the calls, the contract a format file fills in
(`CallFormat`), the vocabulary's special tags (`Tags`), the incremental scanner that reads a
reply whole or streamed, and the grammar helpers.

A format is one file beside this one (hermes.py, llama3_json.py, mistral.py, qwen3_coder.py)
and one line in the registry of `__init__.py`.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# ---- results -----------------------------------------------------------------------------


def openai_call_id() -> str:
    """OpenAI's shape of a call id: "call_" and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def alnum_call_id(length: int = 9) -> str:
    """Mistral's: exactly nine letters and digits (its chat templates refuse any other)."""
    chars = string.ascii_letters + string.digits
    return "".join(secrets.choice(chars) for _ in range(length))


@dataclass(kw_only=True)
class ToolCall:
    """One call: the tool's name and its arguments as JSON text (fields by keyword only)."""

    id: str = field(default_factory=openai_call_id)
    name: str
    arguments: str  # JSON text of the arguments object

    def as_openai(self) -> dict[str, Any]:
        """The call as it appears in a chat completion message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedMessage:
    """A reply split into text, calls and reasoning. `content` is None when it is only
    whitespace and there are calls or reasoning."""

    content: str | None
    tool_calls: list[ToolCall]
    reasoning_content: str | None = None


# ---- the vocabulary's tags ---------------------------------------------------------------


@dataclass(frozen=True)
class Tags:
    """The tags of a format that the model's vocabulary holds as single special tokens, by
    text (`<tool_call>` in Qwen2.5/3 and Hermes, `[TOOL_CALLS]` in Mistral, `<|python_tag|>` in
    Llama 3.1). A grammar must name those as tokens: spelled as a string it would match the
    tag's pieces as plain text, which the model never writes, and llguidance's mask would
    offer the special token and then refuse it."""

    ids: dict[str, int] = field(default_factory=dict)

    def special(self, tag: str) -> bool:
        return tag in self.ids

    def lit(self, tag: str) -> str:
        """The tag in a Lark grammar: the token by id when special, else a string."""
        return f"<[{self.ids[tag]}]>" if tag in self.ids else lit(tag)

    def not_token(self, *tags: str) -> str:
        """Any one token but the given special tags."""
        ids = sorted(self.ids[t] for t in tags if t in self.ids)
        return "<[^" + ",".join(map(str, ids)) + "]>" if ids else "<[*]>"


def forced_grammar(calls: str, rules: list[str]) -> str:
    """A forced call grammar: `calls`, then at most a little whitespace."""
    return "\n".join([f"start: {calls} TRAIL?", TRAIL, *rules]) + "\n"


TRAIL = r"TRAIL: /[ \t\r\n]{1,8}/"


def lit(text: str) -> str:
    """A Lark string literal (it takes JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


# ---- the contract of a format --------------------------------------------------------------


class CallFormat:
    """One tool-call format: how a template shows it, how replies carry calls, and the
    grammars that force a call (`forced`) or check one once the model starts it (`auto`).

    The scanner (`StreamParser`) drives a format through three hooks: `markers` (text that
    may open a call mid-reply), `opens_reply` (a call with no marker, at the reply's start)
    and `call_step` (decide the call at the head of the buffer)."""

    name: ClassVar[str]
    tags: ClassVar[tuple[str, ...]] = ()  # markers that may be single special tokens
    markers: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def detect(cls, template: str) -> bool:
        raise NotImplementedError

    @classmethod
    def variant(cls, template: str | None) -> CallFormat:
        """The format as this template uses it (Mistral's has two call syntaxes)."""
        return cls()

    def new_id(self) -> str:
        return openai_call_id()

    def opens_reply(self, head: str) -> bool:
        """A call may open the reply (after whitespace) with no marker."""
        return False

    def call_step(self, scanner: StreamParser, final: bool) -> bool:
        """`scanner._buf` opens with a call (or what may be one): decide it, or return False
        to wait for more text."""
        raise NotImplementedError

    def after_call_step(self, scanner: StreamParser, final: bool) -> bool:
        """Right after a call; by default anything is text again."""
        scanner._to("text", scanner._buf)
        return True

    # ---- grammars (llguidance's Lark) ------------------------------------------------------

    sep: ClassVar[str] = lit("\n")  # between two calls of a forced reply

    def call_rules(self, fns: list[dict], tags: Tags) -> list[str]:
        """Rules whose `call_rest` is one call to any of `fns` after its trigger (the
        format's first tag)."""
        raise NotImplementedError

    def forced(self, fns: list[dict], parallel: bool, tags: Tags) -> str:
        """A grammar of one or more calls (exactly one unless `parallel`) and nothing else
        (but whitespace: a model that writes a newline before its end of turn must not be
        pushed into another call)."""
        one = f"{tags.lit(self.tags[0])} call_rest"
        calls = f"{one} ({self.sep} {one})*" if parallel else one
        return forced_grammar(calls, self.call_rules(fns, tags))

    def auto_rules(self, fns: list[dict], parallel: bool, tags: Tags) -> tuple[list[str], bool]:
        """`auto`'s call rules, and whether a reply may hold the trigger more than once."""
        return self.call_rules(fns, tags), parallel

    def auto(self, fns: list[dict], parallel: bool, tags: Tags) -> str:
        """A grammar of free text in which a call, once the model opens one with the
        trigger, follows the tools' schemas; at most one call unless `parallel`."""
        rules, repeat = self.auto_rules(fns, parallel, tags)
        trigger, count = self.tags[0], "*" if repeat else "?"
        if tags.special(trigger):
            # Free text is any token but the trigger (special tokens such as <think> too).
            return (
                "\n".join(
                    [
                        f"start: free (call free){count}",
                        f"free: {tags.not_token(trigger)}*",
                        f"call: {tags.lit(trigger)} call_rest",
                        *rules,
                    ]
                )
                + "\n"
            )
        # A text trigger: a lazy lexeme ends free text at the trigger's first appearance.
        return (
            "\n".join(
                [
                    f"start: (call_head call_rest){count} TEXT",
                    f"call_head[lazy]: TEXT {lit(trigger)}",
                    r"TEXT: /(.|\n)*/",
                    *rules,
                ]
            )
            + "\n"
        )


# ---- the scanner -------------------------------------------------------------------------

Phase = Literal["think_open", "think", "reply_start", "text", "call", "after_call"]


class StreamParser:
    """Incremental: `feed(delta_text)` and `finish()` return events shaped as chat-completion
    chunk deltas ({"content"}, {"reasoning_content"}, {"tool_calls": [...]}).

    Text that cannot be the start of a call streams out at once; text that may be is held back
    until decided, and a call goes out whole when it ends. Whitespace is held until text
    follows, so a reply that is only calls has no content. Invariant: for any split of a text,
    the events add up to what `parse` returns for it."""

    def __init__(
        self,
        fmt: CallFormat,
        tool_names: set[str] | None = None,
        reasoning: bool = False,
        *,
        tools: list[dict] | None = None,
    ) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.properties = {f["name"]: properties(f) for f in map(function_of, tools or [])}
        self._buf = ""  # text not yet decided
        self._phase: Phase = "think_open" if reasoning else "reply_start"
        self._strip_reply = False  # drop the whitespace that opens a reply after </think>
        self._scan_from = 0  # where the search for a call's end resumes in _buf
        self._json_state: tuple[int, bool, bool] = (0, False, False)  # depth, in str, escaped
        self._events: list[dict[str, Any]] = []
        self._num_calls = 0
        self._held_ws = {"content": "", "reasoning_content": ""}
        self._started = {"content": False, "reasoning_content": False}
        self._finished = False

    def feed(self, delta_text: str) -> list[dict[str, Any]]:
        """Events for the text so far; call-like text stays held until decided."""
        if self._finished:
            raise ValueError("feed() after finish()")
        self._buf += delta_text
        self._advance(final=False)
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """Events for what was held back: an unclosed or malformed call comes out as content."""
        if not self._finished:
            self._finished = True
            self._advance(final=True)
            if not self._num_calls and not self._started["reasoning_content"]:
                self._events.append({"content": self._held_ws["content"]})
            self._held_ws = {"content": "", "reasoning_content": ""}
        return self._take()

    # ---- what formats call ---------------------------------------------------------------

    def known(self, name: Any) -> bool:
        return isinstance(name, str) and (self.tool_names is None or name in self.tool_names)

    def text(self, key: str, text: str) -> None:
        if not text:
            return
        if not self._started[key]:
            if not text.strip():
                self._held_ws[key] += text
                return
            text, self._held_ws[key] = self._held_ws[key] + text, ""
            self._started[key] = True
        self._events.append({key: text})

    def call(self, call: ToolCall) -> None:
        delta = {"index": self._num_calls, **call.as_openai()}
        self._events.append({"tool_calls": [delta]})
        self._num_calls += 1

    def _to(self, phase: Phase, rest: str) -> None:
        self._phase, self._buf = phase, rest
        self._scan_from, self._json_state = 0, (0, False, False)

    def json_end(self, buf: str, at: int) -> int | None:
        """The end of the JSON object or array opening at `at`, by bracket depth outside
        strings; None while open. The scan resumes where the last one stopped."""
        depth, in_str, escaped = self._json_state
        i = max(at, self._scan_from)
        while i < len(buf):
            c = buf[i]
            i += 1
            if in_str:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i
        self._scan_from, self._json_state = i, (depth, in_str, escaped)
        return None

    def tagged_step(self, open_: str, close: str, body, final: bool) -> bool:
        """`_buf` opens with `open_`: decide the call once `close` comes (False: wait).
        `body(text)` is the call in the text between, or None (then it stays content)."""
        buf = self._buf
        start = max(len(open_), self._scan_from)
        end = buf.find(close, start)
        if end < 0:
            if not final:
                self._scan_from = max(start, len(buf) - len(close) + 1)
                return False
            self.text("content", buf)  # unclosed: the rest of the reply is text
            self._to("text", "")
            return True
        call = body(buf[len(open_) : end])
        stop = end + len(close)
        if call is None:
            self.text("content", buf[:stop])
        else:
            self.call(call)
        self._to("after_call", buf[stop:])
        return True

    # ---- output --------------------------------------------------------------------------

    def _take(self) -> list[dict[str, Any]]:
        merged: list[dict[str, Any]] = []
        for e in self._events:
            ((key, value),) = e.items()
            if key != "tool_calls" and not value:
                continue
            if merged and key != "tool_calls" and key in merged[-1]:
                merged[-1][key] += value
            else:
                merged.append(dict(e))
        self._events = []
        return merged

    # ---- phases --------------------------------------------------------------------------

    def _advance(self, final: bool) -> None:
        """Decide as much of `_buf` as the text so far allows (all of it when `final`)."""
        while True:
            phase, buf = self._phase, self._buf
            if phase == "think_open":
                head = buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self._to("think", head[len(THINK_OPEN) :])
                elif THINK_OPEN.startswith(head) and not final:
                    return
                else:
                    self._to("think", buf)
            elif phase == "think":
                end = buf.find(THINK_CLOSE)
                if end < 0:
                    keep = 0 if final else partial_suffix(buf, (THINK_CLOSE,))
                    self.text("reasoning_content", buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                self.text("reasoning_content", buf[:end])
                self._strip_reply = True
                self._to("reply_start", buf[end + len(THINK_CLOSE) :])
            elif phase == "reply_start":
                head = buf.lstrip()
                if self._strip_reply:
                    buf = self._buf = head
                if not head and not final:
                    return
                if self.fmt.opens_reply(head):
                    self.text("content", buf[: len(buf) - len(head)])
                    self._to("call", head)
                else:
                    self._to("text", buf)
            elif phase == "text":
                found = [(i, m) for m in self.fmt.markers if (i := buf.find(m)) >= 0]
                if not found:
                    keep = 0 if final else partial_suffix(buf, self.fmt.markers)
                    self.text("content", buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                start = min(found)[0]
                self.text("content", buf[:start])
                self._to("call", buf[start:])
            elif phase == "call":
                if not self.fmt.call_step(self, final):
                    return
            elif phase == "after_call":
                if not self.fmt.after_call_step(self, final):
                    return


def partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `buf` that a marker starts with (held back)."""
    if not markers:
        return 0
    for k in range(min(len(buf), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(buf[-k:]) for m in markers):
            return k
    return 0


# ---- JSON and schemas --------------------------------------------------------------------


def json_object(text: str) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def function_of(tool: dict) -> dict:
    """The function of an OpenAI tool dict (a bare function dict passes as is)."""
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool without a function name: {tool!r}")
    return fn


def parameters(fn: dict) -> dict:
    schema = fn.get("parameters") or {}
    return schema if "type" in schema else {"type": "object", **schema}


def properties(fn: dict) -> dict[str, dict]:
    return parameters(fn).get("properties") or {}


def call_schema(fns: list[dict], key: str) -> dict:
    """The JSON schema of one call object {"name": ..., key: arguments} to any of `fns`."""
    objects = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: parameters(f)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in fns
    ]
    return objects[0] if len(objects) == 1 else {"anyOf": objects}


def call_from(scanner: StreamParser, obj: dict | None, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed JSON object with a known "name" and an object of arguments under
    the first of `keys` present; None when it is no such call."""
    if obj is None or not scanner.known(obj.get("name")):
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    if not isinstance(args, dict):
        return None
    return ToolCall(
        id=scanner.fmt.new_id(), name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)
    )
