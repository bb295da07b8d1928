"""OpenAI batch-API lines (`custom_id`, `method`, `url`, `body`) and their answers in the
OpenAI batch output format, so that one job file runs here and on any OpenAI-compatible
batch service (vLLM's `run-batch`, OpenAI's Batch API).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagecli.cli.jsonl_fields import (
    SAMPLING_FIELDS,
    BadLine,
    Job,
    RecordError,
    json_type,
    parse_messages,
    parse_token_ids,
    sampling_params,
)
from pagecli.outputs import RequestOutput

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
LINE_FIELDS = {"custom_id", "method", "url", "body"}
# Body fields mapped onto SamplingParams (the rest of SamplingParams is accepted by name).
BODY_RENAMES = {"max_completion_tokens": "max_tokens"}
# Body fields that do not change the answer here; accepted and ignored.
BODY_IGNORED = {"model", "user", "metadata", "store", "service_tier"}
# Body fields accepted only when they ask for nothing (false or null).
BODY_OFF = {"stream", "logprobs", "echo"}


def parse(
    obj: dict[str, Any], line: int, defaults: dict[str, Any], system: str | None
) -> Job | BadLine:
    """A batch-API line as a Job, or a BadLine answered in the batch error format."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str):
        return BadLine(line, line, "custom_id must be a string")
    url = obj.get("url")
    api = URLS.get(url) if isinstance(url, str) else None
    try:
        unknown = sorted(set(obj) - LINE_FIELDS)
        if unknown:
            raise RecordError(f"unknown field {unknown[0]!r}")
        if obj.get("method", "POST") != "POST":
            raise RecordError(f"method must be POST, got {_short(obj.get('method'))}")
        if api is None:
            raise RecordError(f"url must be one of {', '.join(URLS)}, got {_short(url)}")
        return _job(obj["body"], line, custom_id, api, defaults, system)
    except RecordError as exc:
        return BadLine(line, custom_id, str(exc), api or "chat")


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message, cut short: an input value can be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _job(body: Any, line: int, custom_id: str, api: str, defaults, system) -> Job:
    if not isinstance(body, dict):
        raise RecordError(f"body must be an object, got {json_type(body)}")
    prompt_field = "messages" if api == "chat" else "prompt"
    if prompt_field not in body:
        raise RecordError(f"body.{prompt_field} is required for {api} requests")
    fields = {}
    for key, value in body.items():
        name = BODY_RENAMES.get(key, key)
        if key == prompt_field or key in BODY_IGNORED:
            continue
        if key in BODY_OFF:
            if value not in (None, False):
                raise RecordError(f"body.{key} is not supported")
            continue
        if name not in SAMPLING_FIELDS:
            raise RecordError(f"unknown field body.{key}")
        fields[name] = value
    value = body[prompt_field]
    if api == "chat":
        prompt = parse_messages(value, system)
    elif isinstance(value, str):
        prompt = value
    elif isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        prompt = {"prompt_token_ids": parse_token_ids("body.prompt", value)}
    else:
        raise RecordError("body.prompt must be a string or a list of token ids")
    return Job(line, custom_id, prompt, sampling_params(fields, defaults), api)


def result_record(
    custom_id: str, api: str, output: RequestOutput, usage: dict[str, int], model: str
) -> dict[str, Any]:
    """A batch output line for a finished request."""
    choices = []
    for c in output.outputs:
        choice: dict[str, Any] = {"index": c.index}
        if api == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice.update(logprobs=None, finish_reason=c.finish_reason)
        choices.append(choice)
    body = {
        "id": f"{'chatcmpl' if api == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if api == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "prompt_tokens_details": (
                None
                if usage["cached_tokens"] is None
                else {"cached_tokens": usage["cached_tokens"]}
            ),
        },
    }
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body},
        "error": None,
    }


def error_record(
    custom_id: Any, message: str, line: int, status: int | None = None
) -> dict[str, Any]:
    """A batch output line for a request that cannot run (`line`: where it was read;
    `status`: the HTTP status a server answered it with)."""
    error: dict[str, Any] = {"code": "invalid_request", "message": message, "line": line}
    if status is not None:
        error["status"] = status
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": error,
    }
