"""Tool calls in model text: the call format a chat template uses, parsing a reply (whole or
streamed) into OpenAI tool calls, and the llguidance grammar that forces a call.

The formats:
- `hermes` (Qwen2.5, Qwen3, Hermes):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
- `llama3_json` (Llama 3.1/3.2): `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several joined by `;`; the JSON must open the reply or follow the tag.
- `qwen3_coder`: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>`.

A call that does not parse is never guessed at: its text stays content. Parsing is one
incremental scanner (`StreamParser`); `parse` feeds it the whole text, so a stream and a whole
reply always agree.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

FORMATS = ("hermes", "llama3_json", "qwen3_coder")

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARAM_CLOSE = "</parameter>"

_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAM_OPEN_RE = re.compile(r"\s*<parameter=([^>\n]+)>")
_TOOLS_RE = re.compile(r"\btools\b")

# ---- detection ---------------------------------------------------------------------------


def detect_format(chat_template: str | None) -> str | None:
    """The family's call format, read from the chat template's text; None when it renders no
    tool calls that we know."""
    if not chat_template:
        return None
    t = chat_template
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if TOOL_CALL_OPEN in t:
        return "hermes"
    llama3 = "<|start_header_id|>" in t and _TOOLS_RE.search(t) is not None
    if llama3 and (PYTHON_TAG in t or '"parameters"' in t or "ipython" in t):
        return "llama3_json"
    return None


def detect_reasoning(chat_template: str | None) -> bool:
    """True when the template marks reasoning with <think>...</think>."""
    return bool(chat_template) and THINK_CLOSE in chat_template


# ---- results -----------------------------------------------------------------------------


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(kw_only=True)
class ToolCall:
    """One call: the tool's name and its arguments as JSON text (fields by keyword only)."""

    id: str = field(default_factory=_call_id)  # "call_" + 24 hex digits unless given
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


def parse(
    text: str,
    fmt: str,
    tool_names: set[str] | None = None,
    reasoning: bool = False,
    *,
    tools: list[dict] | None = None,
) -> ParsedMessage:
    """The whole reply. A call that fails to parse (bad JSON, unknown tool when `tool_names` is
    given, arguments not an object, unclosed tag) stays content, text intact. With `reasoning`,
    text up to the first `</think>` (a leading `<think>` dropped) is reasoning_content, all of
    it when no `</think>` comes. `tools` (OpenAI tool dicts) types qwen3_coder's values."""
    parser = StreamParser(fmt, tool_names, reasoning, tools=tools)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.get("content", "") for e in events)
    thought = "".join(e.get("reasoning_content", "") for e in events) or None
    calls = [
        ToolCall(id=d["id"], name=d["function"]["name"], arguments=d["function"]["arguments"])
        for e in events
        for d in e.get("tool_calls", [])
    ]
    if not content and (calls or thought is not None):
        return ParsedMessage(None, calls, thought)
    return ParsedMessage(content, calls, thought)


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
        fmt: str,
        tool_names: set[str] | None = None,
        reasoning: bool = False,
        *,
        tools: list[dict] | None = None,
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"tool call format {fmt!r} is not one of {', '.join(FORMATS)}")
        self.fmt = fmt
        self.tool_names = tool_names
        self._properties = {f["name"]: _properties(f) for f in map(_function, tools or [])}
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

    def _text(self, key: str, text: str) -> None:
        if not text:
            return
        if not self._started[key]:
            if not text.strip():
                self._held_ws[key] += text
                return
            text, self._held_ws[key] = self._held_ws[key] + text, ""
            self._started[key] = True
        self._events.append({key: text})

    def _call(self, call: ToolCall) -> None:
        delta = {"index": self._num_calls, **call.as_openai()}
        self._events.append({"tool_calls": [delta]})
        self._num_calls += 1

    def _to(self, phase: Phase, rest: str) -> None:
        self._phase, self._buf = phase, rest
        self._scan_from, self._json_state = 0, (0, False, False)

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
                    keep = 0 if final else _partial_suffix(buf, (THINK_CLOSE,))
                    self._text("reasoning_content", buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                self._text("reasoning_content", buf[:end])
                self._strip_reply = True
                self._to("reply_start", buf[end + len(THINK_CLOSE) :])
            elif phase == "reply_start":
                head = buf.lstrip()
                if self._strip_reply:
                    buf = self._buf = head
                if not head and not final:
                    return
                if self.fmt == "llama3_json" and head.startswith("{"):
                    self._text("content", buf[: len(buf) - len(head)])
                    self._to("call", head)
                else:
                    self._to("text", buf)
            elif phase == "text":
                marker = PYTHON_TAG if self.fmt == "llama3_json" else TOOL_CALL_OPEN
                start = buf.find(marker)
                if start < 0:
                    keep = 0 if final else _partial_suffix(buf, (marker,))
                    self._text("content", buf[: len(buf) - keep])
                    self._buf = buf[len(buf) - keep :]
                    return
                self._text("content", buf[:start])
                self._to("call", buf[start:])
            elif phase == "call":
                step = self._json_call_step if self.fmt == "llama3_json" else self._tagged_call_step
                if not step(final):
                    return
            elif phase == "after_call":  # llama3_json: `;` joins calls, anything else is text
                head = buf.lstrip()
                if not head and not final:
                    return
                if head.startswith(";"):
                    self._to("call", head[1:])
                else:
                    self._to("text", buf)

    def _tagged_call_step(self, final: bool) -> bool:
        """`_buf` opens with <tool_call>: decide it once </tool_call> comes (False: wait)."""
        buf = self._buf
        start = max(len(TOOL_CALL_OPEN), self._scan_from)
        end = buf.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            if not final:
                self._scan_from = max(start, len(buf) - len(TOOL_CALL_CLOSE) + 1)
                return False
            self._text("content", buf)  # unclosed: the rest of the reply is text
            self._to("text", "")
            return True
        body = buf[len(TOOL_CALL_OPEN) : end]
        call = self._hermes_call(body) if self.fmt == "hermes" else self._xml_call(body)
        stop = end + len(TOOL_CALL_CLOSE)
        if call is None:
            self._text("content", buf[:stop])
        else:
            self._call(call)
        self._to("text", buf[stop:])
        return True

    def _json_call_step(self, final: bool) -> bool:
        """`_buf` may hold a llama3 call (after the tag or a `;`): decide it once its JSON
        object closes (False: wait)."""
        buf = self._buf
        body_at = len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0
        at = len(buf) - len(buf[body_at:].lstrip())
        if at == len(buf) and not final:
            return False
        if at == len(buf) or buf[at] != "{":
            self._text("content", buf[:at])
            self._to("text", buf[at:])
            return True
        end = self._json_object_end(buf, at)
        if end is None:
            if not final:
                return False
            self._text("content", buf)
            self._to("text", "")
            return True
        call = self._llama_call(buf[at:end])
        if call is None:
            self._text("content", buf[:end])
            self._to("text", buf[end:])
        else:
            self._call(call)
            self._to("after_call", buf[end:])
        return True

    def _json_object_end(self, buf: str, at: int) -> int | None:
        """The end of the JSON value opening at `at` by bracket depth, outside strings; None
        while open. The scan resumes where the last one stopped."""
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

    # ---- call bodies ---------------------------------------------------------------------

    def _known(self, name: Any) -> bool:
        return isinstance(name, str) and (self.tool_names is None or name in self.tool_names)

    def _hermes_call(self, body: str) -> ToolCall | None:
        obj = _json_object(body)
        if obj is None or not self._known(obj.get("name")):
            return None
        args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
        if not isinstance(args, dict):
            return None
        return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))

    def _llama_call(self, body: str) -> ToolCall | None:
        obj = _json_object(body)
        if obj is None or not self._known(obj.get("name")):
            return None
        # A JSON answer that happens to have a "name" is no call: the arguments must be there.
        args = obj.get("parameters", obj.get("arguments"))
        if not isinstance(args, dict):
            return None
        return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))

    def _xml_call(self, body: str) -> ToolCall | None:
        m = _FUNCTION_RE.fullmatch(body)
        if m is None or not self._known(name := m.group(1).strip()):
            return None
        inner, pos, args = m.group(2), 0, {}
        while (p := _PARAM_OPEN_RE.match(inner, pos)) is not None:
            end = inner.find(PARAM_CLOSE, p.end())
            key = p.group(1).strip()
            if end < 0 or key in args:
                return None
            value = inner[p.end() : end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _coerce(value, self._properties.get(name, {}).get(key))
            pos = end + len(PARAM_CLOSE)
        if inner[pos:].strip():
            return None
        return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def _partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `buf` that a marker starts with (held back)."""
    for k in range(min(len(buf), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(buf[-k:]) for m in markers):
            return k
    return 0


def _json_object(text: str) -> dict | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _schema_type(schema: dict | None) -> str | None:
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def _coerce(value: str, schema: dict | None) -> Any:
    """A qwen3_coder value (plain text) as the JSON type its schema asks for; the text itself
    when the schema is unknown, asks for a string, or the text does not fit."""
    kind = _schema_type(schema)
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind in ("integer", "number", "object", "array", "null"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        fits = {
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
            "null": lambda v: v is None,
        }[kind]
        return parsed if fits(parsed) else value
    return value


# ---- grammars ----------------------------------------------------------------------------


def _function(tool: dict) -> dict:
    """The function of an OpenAI tool dict (a bare function dict passes as is)."""
    fn = tool.get("function", tool)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool without a function name: {tool!r}")
    return fn


def _parameters(fn: dict) -> dict:
    schema = fn.get("parameters") or {}
    return schema if "type" in schema else {"type": "object", **schema}


def _properties(fn: dict) -> dict[str, dict]:
    return _parameters(fn).get("properties") or {}


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def call_grammar(
    fmt: str, tools: list[dict], name: str | None = None, parallel: bool = True
) -> str:
    """A grammar in llguidance's Lark syntax for one or more calls in `fmt` to any of `tools`
    (exactly one, to that tool, when `name` is given; exactly one when `parallel` is false),
    arguments held to each tool's schema.
    qwen3_coder values keep schema order and scalar types; string values are free text."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r} is not one of {', '.join(FORMATS)}")
    fns = [_function(t) for t in tools]
    if name is not None:
        chosen = [f for f in fns if f["name"] == name]
        if not chosen:
            known = ", ".join(f["name"] for f in fns) or "none"
            raise ValueError(f"tool_choice names {name!r}, not one of the tools ({known})")
        fns = chosen[:1]
    if not fns:
        raise ValueError("a tool call grammar needs at least one tool")
    if fmt == "qwen3_coder":
        rules, sep = _xml_rules(fns), '"\\n"'
    else:
        key = "arguments" if fmt == "hermes" else "parameters"
        objects = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: _parameters(f)},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for f in fns
        ]
        schema = objects[0] if len(objects) == 1 else {"anyOf": objects}
        if fmt == "hermes":
            open_, close = _lit(TOOL_CALL_OPEN + "\n"), _lit("\n" + TOOL_CALL_CLOSE)
            rules = [f"call: {open_} call_body {close}", f"call_body: %json {json.dumps(schema)}"]
            sep = '"\\n"'
        else:
            rules, sep = [f"call: %json {json.dumps(schema)}"], '";" " "?'
    start = "start: call" if name is not None or not parallel else f"start: call ({sep} call)*"
    return "\n".join([start, *rules]) + "\n"


def _xml_rules(fns: list[dict]) -> list[str]:
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(fns)))]
    # Free text up to the first "\n</parameter>" (lazy: the shortest match ends the value).
    rules.append(r"text_value[lazy]: /(?s:.*)\n<\/parameter>/")
    for i, fn in enumerate(fns):
        schema = _parameters(fn)
        props, required = schema.get("properties") or {}, set(schema.get("required") or [])
        parts = []
        for k, (key, prop) in enumerate(props.items()):
            rule, open_ = f"p_{i}_{k}", _lit(f"<parameter={key}>\n")
            value = _xml_value(f"v_{i}_{k}", prop if isinstance(prop, dict) else {}, rules)
            rules.append(f"{rule}: {open_} {value}")
            parts.append(rule if key in required else rule + "?")
        if not props and schema.get("additionalProperties") is not False:
            rules.append(f'any_{i}: "<parameter=" /[^<>\\n]+/ ">\\n" text_value "\\n"')
            parts.append(f"any_{i}*")
        head = _lit(f"{TOOL_CALL_OPEN}\n<function={fn['name']}>\n")
        tail = _lit(f"</function>\n{TOOL_CALL_CLOSE}")
        rules.append(f"call_{i}: {head} {' '.join(parts)} {tail}")
    return rules


def _xml_value(rule: str, prop: dict, rules: list[str]) -> str:
    """The grammar of one parameter's value and its closing tag, as a rule body part."""
    close = _lit(f"\n{PARAM_CLOSE}\n")
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(_lit(v) for v in enum) + ") " + close
    kind = _schema_type(prop)
    if kind == "integer":
        return r"/-?(0|[1-9][0-9]*)/ " + close
    if kind == "number":
        return r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/ " + close
    if kind == "boolean":
        return '("true" | "false") ' + close
    if kind in ("object", "array"):
        rules.append(f"{rule}: %json {json.dumps(prop)}")
        return f"{rule} {close}"
    return 'text_value "\\n"'
