"""The JSONL records of `pagecli generate`: input lines parsed into jobs, results and errors
formatted as output records (jsonl_io.py reads the files).

Pure functions over plain data; the engine is not touched here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from pagecli.outputs import RequestOutput, TokenLogprob
from pagecli.sampling_params import SamplingParams, StructuredOutputs

Api = Literal["native", "chat", "completions"]  # chat/completions: an OpenAI batch line
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# The OpenAI (`response_format`) and vLLM (`structured_outputs`) spellings of `structured`.
STRUCTURED_FIELDS = ("structured", "response_format", "structured_outputs")
# Record fields that set sampling: SamplingParams' own and the other spellings of `structured`
# (sampling_params maps those; OpenAI batch bodies take the same fields).
SAMPLING_FIELDS = SamplingParams.field_names() | set(STRUCTURED_FIELDS)
KNOWN_FIELDS = {"id", *PROMPT_FIELDS, *SAMPLING_FIELDS}
# Characters that end a line for str.splitlines() (and editors, older JavaScript) but that
# json.dumps(ensure_ascii=False) writes raw inside strings: escaped so a record stays one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


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


def parse_line(
    raw: bytes, line: int, defaults: dict[str, Any], system: str | None = None
) -> Job | BadLine | None:
    """One input line as a Job, a BadLine, or None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BadLine(
            line, line, f"line is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        )
    text = text.strip()
    if not text:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(line, line, f"not valid JSON: {exc.msg} at column {exc.colno}")
    except ValueError as exc:  # an integer of more than 4300 digits
        return BadLine(line, line, f"not valid JSON: {str(exc).split(';')[0]}")
    except RecursionError:
        return BadLine(line, line, "not valid JSON: nested too deeply")
    if not isinstance(obj, dict):
        return BadLine(line, line, f"expected a JSON object, got {json_type(obj)}")
    if "custom_id" in obj and "body" in obj:
        from pagecli.cli import openai_batch  # imports this module: import on use

        return openai_batch.parse(obj, line, defaults, system)
    record_id = obj.get("id", line)
    if not is_valid_id(record_id):
        got = "a non-finite number" if isinstance(record_id, float) else json_type(record_id)
        return BadLine(line, line, f"id must be a string or a finite number, got {got}")
    try:
        unknown = sorted(set(obj) - KNOWN_FIELDS)
        if unknown:
            raise RecordError(f"unknown field {unknown[0]!r}")
        prompt = parse_prompt(obj, system)
        params = sampling_params({k: v for k, v in obj.items() if k in SAMPLING_FIELDS}, defaults)
    except RecordError as exc:
        return BadLine(line, record_id, str(exc))
    return Job(line, record_id, prompt, params)


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


# ---- output records -----------------------------------------------------------------------


def usage(output: RequestOutput) -> dict[str, int | None]:
    """Token counts: the engine's own, or what a remote server reported (its cached_tokens is
    None when it did not say)."""
    if output.server is not None:
        return {
            "prompt_tokens": output.server.prompt_tokens,
            "completion_tokens": output.server.completion_tokens,
            "cached_tokens": output.server.cached_tokens,
        }
    return {
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(len(c.token_ids) for c in output.outputs),
        "cached_tokens": output.num_cached_tokens,
    }


def result_record(job: Job, output: RequestOutput, model: str) -> dict[str, Any]:
    """The answer to a finished job."""
    if job.api != "native":
        from pagecli.cli import openai_batch

        return openai_batch.result_record(job.id, job.api, output, usage(output), model)
    known_ids = output.server is None or output.server.has_token_ids
    record: dict[str, Any] = {
        "id": job.id,
        "text": output.text,
        "token_ids": output.token_ids if known_ids else None,
        "finish_reason": output.finish_reason,
        "usage": usage(output),
        "error": None,
    }
    if output.outputs and _logprobs(output, 0) is not None:
        record["logprobs"] = _logprobs(output, 0)
    if len(output.outputs) > 1:
        record["choices"] = []
        for i, c in enumerate(output.outputs):
            choice = {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids if known_ids else None,
                "finish_reason": c.finish_reason,
            }
            if _logprobs(output, i) is not None:
                choice["logprobs"] = _logprobs(output, i)
            record["choices"].append(choice)
    return record


def _logprobs(output: RequestOutput, i: int) -> Any:
    """Sample i's logprobs: the engine's as logprobs_json, or the server's object as sent."""
    c = output.outputs[i]
    if c.logprobs is not None:
        return logprobs_json(c.logprobs)
    if output.server is not None and i < len(output.server.logprobs):
        return output.server.logprobs[i]
    return None


def logprobs_json(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """One object per generated token: its id and log-probability, and the most likely."""
    return [
        {
            "token_id": e.token_id,
            "logprob": e.logprob,
            "top": [{"token_id": t, "logprob": lp} for t, lp in e.top],
        }
        for e in entries
    ]


def error_record(
    item: Job | BadLine, message: str, prompt_tokens: int = 0, status: int | None = None
) -> dict[str, Any]:
    """The answer to a line that cannot run (`status`: the HTTP status a server gave)."""
    if item.api != "native":
        from pagecli.cli import openai_batch

        return openai_batch.error_record(item.id, message, item.line, status)
    error: dict[str, Any] = {"message": message, "line": item.line}
    if status is not None:
        error["status"] = status
    return {
        "id": item.id,
        "text": "",
        "token_ids": [],
        "finish_reason": "error",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "cached_tokens": 0},
        "error": error,
    }


def encode_record(record: dict[str, Any]) -> bytes:
    """One JSONL line, UTF-8, that every line splitter sees as one line: U+2028, U+2029 and
    U+0085 are escaped (as Go's encoding/json does the first two); text that cannot be
    encoded (lone surrogates) is escaped too."""
    text = json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")
