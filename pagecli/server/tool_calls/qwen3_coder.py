"""Qwen3-Coder's XML calls:
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n
</tool_call>`. Values are plain text, read as the JSON type the tool's schema gives them. The
blocks and their tags are Hermes's; only what is inside them differs."""

from __future__ import annotations

import json
import re
from typing import Any

from pagecli.server.tool_calls.base import StreamParser, Tags, ToolCall, lit, parameters
from pagecli.server.tool_calls.hermes import CLOSE, Hermes

PARAM_CLOSE = "</parameter>"

_FUNCTION_RE = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAM_OPEN_RE = re.compile(r"\s*<parameter=([^>\n]+)>")


class Qwen3Coder(Hermes):
    name = "qwen3_coder"

    @classmethod
    def detect(cls, template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def body(self, scanner: StreamParser, body: str) -> ToolCall | None:
        m = _FUNCTION_RE.fullmatch(body)
        if m is None or not scanner.known(name := m.group(1).strip()):
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
            args[key] = coerce(value, scanner.properties.get(name, {}).get(key))
            pos = end + len(PARAM_CLOSE)
        if inner[pos:].strip():
            return None
        return ToolCall(id=self.new_id(), name=name, arguments=json.dumps(args, ensure_ascii=False))

    def call_rules(self, fns: list[dict], tags: Tags) -> list[str]:
        """Values keep schema order and scalar types; string values are free text."""
        rules = [
            'call_rest: "\\n" (' + " | ".join(f"call_{i}" for i in range(len(fns))) + ")",
            # Free text up to the first "\n</parameter>" (lazy: the shortest match ends it).
            r"text_value[lazy]: /(?s:.*)\n<\/parameter>/",
        ]
        for i, fn in enumerate(fns):
            schema = parameters(fn)
            props, required = schema.get("properties") or {}, set(schema.get("required") or [])
            parts = []
            for k, (key, prop) in enumerate(props.items()):
                rule, open_ = f"p_{i}_{k}", lit(f"<parameter={key}>\n")
                value = _value(f"v_{i}_{k}", prop if isinstance(prop, dict) else {}, rules)
                rules.append(f"{rule}: {open_} {value}")
                parts.append(rule if key in required else rule + "?")
            if not props and schema.get("additionalProperties") is not False:
                rules.append(f'any_{i}: "<parameter=" /[^<>\\n]+/ ">\\n" text_value "\\n"')
                parts.append(f"any_{i}*")
            head = lit(f"<function={fn['name']}>\n")
            rules.append(
                f"call_{i}: {head} {' '.join(parts)} {lit('</function>' + chr(10))} "
                f"{tags.lit(CLOSE)}"
            )
        return rules


def _value(rule: str, prop: dict, rules: list[str]) -> str:
    """The grammar of one parameter's value and its closing tag, as a rule body part."""
    close = lit(f"\n{PARAM_CLOSE}\n")
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lit(v) for v in enum) + ") " + close
    kind = schema_type(prop)
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


def schema_type(schema: dict | None) -> str | None:
    kind = (schema or {}).get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def coerce(value: str, schema: dict | None) -> Any:
    """A value (plain text) as the JSON type its schema asks for; the text itself when the
    schema is unknown, asks for a string, or the text does not fit."""
    kind = schema_type(schema)
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
