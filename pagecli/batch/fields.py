"""The fields of a `pagecli generate` input record and their parsers, shared by the native
records (jsonl.py) and OpenAI batch lines (openai_batch.py). Pure functions over plain data."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pagecli.sampling_params import SamplingParams, StructuredOutputs

Api = Literal["native", "chat", "completions"]  # chat/completions: an OpenAI batch line
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# The OpenAI (`response_format`) and vLLM (`structured_outputs`) spellings of `structured`.
STRUCTURED_FIELDS = ("structured", "response_format", "structured_outputs")
# Record fields that set sampling: SamplingParams' own and the other spellings of `structured`
# (sampling_params maps those; OpenAI batch bodies take the same fields).
SAMPLING_FIELDS = SamplingParams.field_names() | set(STRUCTURED_FIELDS)
KNOWN_FIELDS = {"id", *PROMPT_FIELDS, *SAMPLING_FIELDS}


class RecordError(ValueError):
    """What is wrong with one input record; the message names the field."""


@dataclass
class Job:
    """A valid input record: what to run and how to answer."""

    line: int  # 1-based line number in the input
    id: Any  # a JSON string or number (the OpenAI `custom_id` for batch-API lines)
    prompt: Any  # str, chat messages, or {"prompt_token_ids": [...]} (LLM.encode_prompt)
    params: SamplingParams
    api: Api = "native"


@dataclass
class BadLine:
    """An input line that cannot run; it is answered by an error record."""

    line: int
    id: Any
    message: str
    api: Api = "native"


def long_line(line: int, num_bytes: int, max_line_bytes: int) -> BadLine:
    """The answer to a line that was too long to read."""
    return BadLine(
        line,
        line,
        f"line of {num_bytes} bytes is over --max-line-bytes ({max_line_bytes}); skipped",
    )


def id_key(record_id: Any) -> str:
    """Ids compare as exact JSON values: 1, 1.0 and "1" are three different ids."""
    return json.dumps(record_id, sort_keys=True)


def is_valid_id(value: Any) -> bool:
    """Strings and finite numbers (NaN and Infinity, which Python's json reads, are no JSON)."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def parse_prompt(obj: dict[str, Any], system: str | None) -> Any:
    """The one prompt field of a native record, in the form LLM.encode_prompt takes."""
    given = [f for f in PROMPT_FIELDS if f in obj]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise RecordError(f"give exactly one of prompt, messages, prompt_token_ids (got {what})")
    field = given[0]
    value = obj[field]
    if field == "prompt":
        if not isinstance(value, str):
            raise RecordError(f"prompt must be a string, got {json_type(value)}")
        return value
    if field == "messages":
        return parse_messages(value, system)
    return {"prompt_token_ids": parse_token_ids("prompt_token_ids", value)}


def parse_token_ids(field: str, value: Any) -> list[int]:
    ok = (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )
    if not ok:
        raise RecordError(f"{field} must be a non-empty list of non-negative integers")
    return list(value)


def parse_messages(value: Any, system: str | None) -> list[dict[str, Any]]:
    """Chat messages, each with a string role and content (text parts are joined); `system`
    is prepended when the conversation has no system message."""
    if not isinstance(value, list) or not value:
        raise RecordError("messages must be a non-empty list of {role, content} objects")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RecordError(f"messages[{i}] must be an object, got {json_type(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RecordError(f"messages[{i}].role must be a non-empty string")
        if isinstance(content, list):  # OpenAI content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RecordError(f"messages[{i}].content parts must all be of type text")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise RecordError(f"messages[{i}].content must be a string")
        messages.append({**message, "content": content})
    if system is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def sampling_params(fields: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a record's fields over the CLI defaults."""
    if "skip_special_tokens" in fields and not isinstance(fields["skip_special_tokens"], bool):
        raise RecordError("skip_special_tokens must be true or false")
    fields = structured_field(fields)
    try:
        return SamplingParams(**{**defaults, **fields})
    except (TypeError, ValueError) as exc:
        raise RecordError(str(exc)) from None


def structured_field(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with `response_format` or `structured_outputs` turned into `structured`; a
    record that gives more than one of the three is a RecordError. A given field replaces the
    CLI's default constraint, even with none (`{"type": "text"}`, null)."""
    given = [f for f in STRUCTURED_FIELDS if f in fields]
    if len(given) > 1:
        raise RecordError(f"{' and '.join(given)}: give one of them (each sets the constraint)")
    if not given or given[0] == "structured":
        return fields
    name = given[0]
    rest = {k: v for k, v in fields.items() if k != name}
    try:
        rest["structured"] = StructuredOutputs.from_openai(**{name: fields[name]})
    except ValueError as exc:
        raise RecordError(str(exc)) from None
    except RecursionError:  # strict mode walks the schema: one nested a thousand deep
        raise RecordError(f"{name}: nested too deeply") from None
    return rest
