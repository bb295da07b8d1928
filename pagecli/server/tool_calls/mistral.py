"""Mistral's calls after the `[TOOL_CALLS]` control token, in the two syntaxes its
templates use:
- JSON (Mistral 7B v0.3, Nemo, Small 3.0/3.1): `[TOOL_CALLS] [{"name": ..., "arguments":
  {...}}, ...]`, every call of a reply in one array;
- `[ARGS]` (Small 3.2, Devstral, Magistral; tokenizer v11+): `[TOOL_CALLS]NAME[ARGS]{...}`
  per call, with `[CALL_ID]ID` between name and arguments in some versions.

Call ids are nine letters and digits: Mistral's templates refuse tool results whose
`tool_call_id` is anything else."""

from __future__ import annotations

import json
import re

from pagecli.server.tool_calls.base import (
    CallFormat,
    StreamParser,
    Tags,
    ToolCall,
    alnum_call_id,
    call_from,
    call_schema,
    forced_grammar,
    lit,
    parameters,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAMED_RE = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]\s*")
# What may still become a named call: a name, then the start of [CALL_ID]id or [ARGS].
_NAMED_PREFIX_RE = re.compile(r"\s*[A-Za-z0-9_.\-]*(\[[A-Z_]*\]?[A-Za-z0-9]*)*")


class Mistral(CallFormat):
    name = "mistral"
    tags = (TOOL_CALLS, ARGS)
    markers = (TOOL_CALLS,)
    sep = ""

    def __init__(self, args_syntax: bool = False) -> None:
        self.args_syntax = args_syntax  # the grammars write NAME[ARGS]{...} (else a JSON list)

    @classmethod
    def detect(cls, template: str) -> bool:
        return TOOL_CALLS in template

    @classmethod
    def variant(cls, template: str | None) -> Mistral:
        return cls(args_syntax=ARGS in (template or ""))

    def new_id(self) -> str:
        return alnum_call_id()

    def call_step(self, scanner: StreamParser, final: bool) -> bool:
        buf = scanner._buf  # opens with [TOOL_CALLS]
        at = len(TOOL_CALLS)
        rest = buf[at:]
        head = rest.lstrip()
        if not head and not final:
            return False
        if head.startswith("["):  # the JSON list
            start = len(buf) - len(head)
            end = scanner.json_end(buf, start)
            if end is None:
                return self._undecided(scanner, final)
            calls = self._list(scanner, buf[start:end])
            if calls is None:
                scanner.text("content", buf[:end])
            else:
                for call in calls:
                    scanner.call(call)
            scanner._to("after_call", buf[end:])
            return True
        m = _NAMED_RE.match(rest)
        if m is None:
            p = _NAMED_PREFIX_RE.match(rest)
            if p is not None and p.end() == len(rest) and not final:
                return False  # still a name or a tag in the making
            scanner.text("content", buf[:at])  # the marker with no call after it is text
            scanner._to("text", rest)
            return True
        start = at + m.end()
        if start == len(buf) or buf[start] != "{":
            if start == len(buf) and not final:
                return False
            scanner.text("content", buf[:start])
            scanner._to("text", buf[start:])
            return True
        end = scanner.json_end(buf, start)
        if end is None:
            return self._undecided(scanner, final)
        call = call_from(
            scanner, {"name": m.group(1), "arguments": _loads(buf[start:end])}, ("arguments",)
        )
        if call is None:
            scanner.text("content", buf[:end])
        else:
            call.id = m.group(2) or call.id
            scanner.call(call)
        scanner._to("after_call", buf[end:])
        return True

    @staticmethod
    def _undecided(scanner: StreamParser, final: bool) -> bool:
        if not final:
            return False
        scanner.text("content", scanner._buf)
        scanner._to("text", "")
        return True

    def _list(self, scanner: StreamParser, text: str) -> list[ToolCall] | None:
        """Every call of the list, or None when any one is no call (then all are text)."""
        items = _loads(text)
        if not isinstance(items, list) or not items:
            return None
        calls = [call_from(scanner, item if isinstance(item, dict) else None, ("arguments",))
                 for item in items]  # fmt: skip
        if any(c is None for c in calls):
            return None
        for call, item in zip(calls, items, strict=True):
            given = item.get("id")
            if isinstance(given, str) and given.isalnum():
                call.id = given
        return calls

    # ---- grammars ------------------------------------------------------------------------

    def call_rules(self, fns: list[dict], tags: Tags) -> list[str]:
        if self.args_syntax:
            names = " | ".join(f"call_{i}" for i in range(len(fns)))
            rules = [f"call_rest: {names}"]
            for i, fn in enumerate(fns):
                body = json.dumps(parameters(fn))
                rules.append(f"call_{i}: {lit(fn['name'])} {tags.lit(ARGS)} args_{i}")
                rules.append(f"args_{i}: %json {body}")
            return rules
        return self._list_rules(fns, parallel=True)

    @staticmethod
    def _list_rules(fns: list[dict], parallel: bool) -> list[str]:
        schema = {"type": "array", "items": call_schema(fns, "arguments"), "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return ['call_rest: " "? call_list', f"call_list: %json {json.dumps(schema)}"]

    def forced(self, fns: list[dict], parallel: bool, tags: Tags) -> str:
        if self.args_syntax:
            return super().forced(fns, parallel, tags)
        rules = self._list_rules(fns, parallel)  # one list holds every call
        return forced_grammar(f"{tags.lit(TOOL_CALLS)} call_rest", rules)

    def auto_rules(self, fns: list[dict], parallel: bool, tags: Tags) -> tuple[list[str], bool]:
        if self.args_syntax:
            return self.call_rules(fns, tags), parallel
        return self._list_rules(fns, parallel), False  # one list holds every call


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
