"""Tool calls in model text: the registry of call formats (one file each), detection from
the chat template, parsing a reply (whole or streamed) into OpenAI tool calls, and the
llguidance grammars that force a call (`tool_choice` "required" or a named tool) or check
one once the model opens it (`auto`).

A call that does not parse is never guessed at: its text stays content. Parsing is one
incremental scanner (`StreamParser`); `parse` feeds it the whole text, so a stream and a whole
reply always agree.

To add a format: a file with a `CallFormat` subclass (see base.py) and a line in `_REGISTRY`.
"""

from __future__ import annotations

from pagecli.server.tool_calls import base
from pagecli.server.tool_calls.base import (
    THINK_CLOSE,
    CallFormat,
    ParsedMessage,
    Tags,
    ToolCall,
    function_of,
)
from pagecli.server.tool_calls.hermes import Hermes
from pagecli.server.tool_calls.llama3_json import Llama3Json
from pagecli.server.tool_calls.mistral import Mistral
from pagecli.server.tool_calls.qwen3_coder import Qwen3Coder

# In the order detection tries them (Qwen3-Coder's templates also name <tool_call>).
_REGISTRY: dict[str, type[CallFormat]] = {
    f.name: f for f in (Qwen3Coder, Mistral, Hermes, Llama3Json)
}
FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder")  # `--tool-call-parser` choices
assert set(FORMATS) == set(_REGISTRY)

__all__ = [
    "FORMATS",
    "THINK_CLOSE",
    "CallFormat",
    "ParsedMessage",
    "StreamParser",
    "Tags",
    "ToolCall",
    "auto_grammar",
    "call_grammar",
    "detect_format",
    "detect_reasoning",
    "get_format",
    "parse",
]


def get_format(name: str | CallFormat, chat_template: str | None = None) -> CallFormat:
    """The format called `name`, as `chat_template` uses it."""
    if isinstance(name, CallFormat):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"tool call format {name!r} is not one of {', '.join(FORMATS)}")
    return _REGISTRY[name].variant(chat_template)


def detect_format(chat_template: str | None) -> str | None:
    """The family's call format, read from the chat template's text; None when it renders no
    tool calls that we know."""
    if not chat_template:
        return None
    return next((name for name, f in _REGISTRY.items() if f.detect(chat_template)), None)


def detect_reasoning(chat_template: str | None) -> bool:
    """True when the template marks reasoning with <think>...</think>."""
    return bool(chat_template) and THINK_CLOSE in chat_template


class StreamParser(base.StreamParser):
    """The scanner of base.py for a format given by name or object."""

    def __init__(
        self,
        fmt: str | CallFormat,
        tool_names: set[str] | None = None,
        reasoning: bool = False,
        *,
        tools: list[dict] | None = None,
    ) -> None:
        super().__init__(get_format(fmt), tool_names, reasoning, tools=tools)


def parse(
    text: str,
    fmt: str | CallFormat,
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


def _functions(tools: list[dict], name: str | None) -> list[dict]:
    fns = [function_of(t) for t in tools]
    if name is not None:
        chosen = [f for f in fns if f["name"] == name]
        if not chosen:
            known = ", ".join(f["name"] for f in fns) or "none"
            raise ValueError(f"tool_choice names {name!r}, not one of the tools ({known})")
        fns = chosen[:1]
    if not fns:
        raise ValueError("a tool call grammar needs at least one tool")
    return fns


def call_grammar(
    fmt: str | CallFormat,
    tools: list[dict],
    name: str | None = None,
    parallel: bool = True,
    tags: Tags | None = None,
) -> str:
    """A grammar in llguidance's Lark syntax for one or more calls in `fmt` to any of `tools`
    (exactly one, to that tool, when `name` is given; exactly one when `parallel` is false),
    arguments held to each tool's schema. `tags`: the format's tags that are special tokens
    of the model's vocabulary (none: all spelled as text)."""
    f = get_format(fmt)
    fns = _functions(tools, name)
    return f.forced(fns, parallel and name is None, tags or Tags())


def auto_grammar(
    fmt: str | CallFormat, tools: list[dict], parallel: bool = True, tags: Tags | None = None
) -> str:
    """A grammar for tool_choice "auto": any reply, but a call the model opens (with the
    format's trigger) follows one of `tools`' schemas."""
    return get_format(fmt).auto(_functions(tools, None), parallel, tags or Tags())
