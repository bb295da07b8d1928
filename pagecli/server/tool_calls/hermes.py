"""Hermes (Qwen2.5, Qwen3, NousResearch Hermes and many fine-tunes):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.

`<tool_call>` and `</tool_call>` are single tokens in Qwen's vocabulary (special to
llguidance), plain text in some fine-tunes'; the grammars take either."""

from __future__ import annotations

import json

from pagecli.server.tool_calls.base import (
    CallFormat,
    StreamParser,
    Tags,
    ToolCall,
    call_from,
    call_schema,
    json_object,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(CallFormat):
    name = "hermes"
    tags = (OPEN, CLOSE)
    markers = (OPEN,)

    @classmethod
    def detect(cls, template: str) -> bool:
        return OPEN in template

    def call_step(self, scanner: StreamParser, final: bool) -> bool:
        return scanner.tagged_step(OPEN, CLOSE, lambda body: self.body(scanner, body), final)

    def body(self, scanner: StreamParser, body: str) -> ToolCall | None:
        """The call between the tags, or None (then the block stays text)."""
        obj = json_object(body)
        if obj is not None and "arguments" not in obj and "parameters" not in obj:
            obj = {**obj, "arguments": {}}  # a call of a tool without parameters
        return call_from(scanner, obj, ("arguments", "parameters"))

    def call_rules(self, fns: list[dict], tags: Tags) -> list[str]:
        schema = json.dumps(call_schema(fns, "arguments"))
        return [
            f'call_rest: "\\n" call_body "\\n" {tags.lit(CLOSE)}',
            f"call_body: %json {schema}",
        ]
