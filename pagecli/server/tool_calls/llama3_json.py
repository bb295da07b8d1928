"""Llama 3.1/3.2/3.3 JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>` (a special token in Llama 3's vocabulary), several joined by `;`. The JSON
must open the reply or follow the tag: a JSON object mid-text is text."""

from __future__ import annotations

import json
import re

from pagecli.server.tool_calls.base import (
    CallFormat,
    StreamParser,
    Tags,
    call_from,
    call_schema,
    forced_grammar,
    json_object,
)

PYTHON_TAG = "<|python_tag|>"
_TOOLS_RE = re.compile(r"\btools\b")


class Llama3Json(CallFormat):
    name = "llama3_json"
    tags = (PYTHON_TAG,)
    markers = (PYTHON_TAG,)
    sep = '";" " "?'

    @classmethod
    def detect(cls, template: str) -> bool:
        llama3 = "<|start_header_id|>" in template and _TOOLS_RE.search(template) is not None
        return llama3 and (
            PYTHON_TAG in template or '"parameters"' in template or "ipython" in template
        )

    def opens_reply(self, head: str) -> bool:
        return head.startswith("{")

    def call_step(self, scanner: StreamParser, final: bool) -> bool:
        """`_buf` may hold a call (after the tag or a `;`): decide it once its JSON object
        closes (False: wait)."""
        buf = scanner._buf
        body_at = len(PYTHON_TAG) if buf.startswith(PYTHON_TAG) else 0
        at = len(buf) - len(buf[body_at:].lstrip())
        if at == len(buf) and not final:
            return False
        if at == len(buf) or buf[at] != "{":
            scanner.text("content", buf[:at])
            scanner._to("text", buf[at:])
            return True
        end = scanner.json_end(buf, at)
        if end is None:
            if not final:
                return False
            scanner.text("content", buf)
            scanner._to("text", "")
            return True
        # A JSON answer that happens to have a "name" is no call: the arguments must be there.
        call = call_from(scanner, json_object(buf[at:end]), ("parameters", "arguments"))
        if call is None:
            scanner.text("content", buf[:end])
            scanner._to("text", buf[end:])
        else:
            scanner.call(call)
            scanner._to("after_call", buf[end:])
        return True

    def after_call_step(self, scanner: StreamParser, final: bool) -> bool:
        """`;` joins calls; anything else is text."""
        head = scanner._buf.lstrip()
        if not head and not final:
            return False
        if head.startswith(";"):
            scanner._to("call", head[1:])
        else:
            scanner._to("text", scanner._buf)
        return True

    def call_rules(self, fns: list[dict], tags: Tags) -> list[str]:
        return [f"call_rest: %json {json.dumps(call_schema(fns, 'parameters'))}"]

    def _tag(self, tags: Tags) -> str:
        # The tag is optional where it is one token; spelled out it is never written.
        return f"{tags.lit(PYTHON_TAG)}?" if tags.special(PYTHON_TAG) else ""

    def forced(self, fns: list[dict], parallel: bool, tags: Tags) -> str:
        calls = f"call_rest ({self.sep} call_rest)*" if parallel else "call_rest"
        return forced_grammar(f"{self._tag(tags)} {calls}", self.call_rules(fns, tags))

    def auto(self, fns: list[dict], parallel: bool, tags: Tags) -> str:
        """Text that does not open with `{`, or calls (after the tag where it is a token).
        The text is read by characters: special tokens other than the tag are refused in it
        (Llama 3 writes none in a reply but its end of turn, which ends it)."""
        calls = f"call_rest ({self.sep} call_rest)*" if parallel else "call_rest"
        return (
            "\n".join(
                [
                    f"start: TEXT? | {self._tag(tags)} {calls}",
                    r"TEXT: /[^{\s](.|\n)*|\s+([^{\s](.|\n)*)?/",
                    *self.call_rules(fns, tags),
                ]
            )
            + "\n"
        )
