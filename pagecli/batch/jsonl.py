"""The JSONL records of `pagecli generate`: input lines parsed into jobs, results and errors
formatted as output records (files.py reads the files).

Pure functions over plain data; the engine is not touched here.
"""

from __future__ import annotations

import json
from typing import Any

from pagecli.batch.fields import (
    KNOWN_FIELDS,
    SAMPLING_FIELDS,
    BadLine,
    Job,
    RecordError,
    id_key,
    is_valid_id,
    json_type,
    long_line,
    parse_prompt,
    sampling_params,
)
from pagecli.outputs import RequestOutput, TokenLogprob

# Names the commands and tests read from here (defined in fields.py).
__all__ = [
    "KNOWN_FIELDS",
    "BadLine",
    "Job",
    "encode_record",
    "error_record",
    "id_key",
    "is_valid_id",
    "json_type",
    "long_line",
    "parse_line",
    "result_record",
]

# Characters that end a line for str.splitlines() (and editors, older JavaScript) but that
# json.dumps(ensure_ascii=False) writes raw inside strings: escaped so a record stays one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


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
        from pagecli.batch import openai_batch  # loaded for batch lines only

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
        from pagecli.batch import openai_batch

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
        from pagecli.batch import openai_batch

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
