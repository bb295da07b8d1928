"""OpenAI batch-API lines (`custom_id`, `method`, `url`, `body`) and their answers in the
OpenAI batch output format, so that one job file runs here and on any OpenAI-compatible
batch service (vLLM's `run-batch`, OpenAI's Batch API).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pagecli.batch.fields import BadLine, Job, RecordError, json_type, parse_messages
from pagecli.outputs import RequestOutput

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
LINE_FIELDS = {"custom_id", "method", "url", "body"}


def parse(
    obj: dict[str, Any], line: int, defaults: dict[str, Any], system: str | None
) -> Job | BadLine:
    """A batch-API line as a Job, or a BadLine answered in the batch error format. The body
    is validated by the server's own request models (pagecli/openai/protocol.py)."""
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
        return _job(obj["body"], line, custom_id, url, api, defaults, system)
    except RecordError as exc:
        return BadLine(line, custom_id, str(exc), api or "chat")


def _short(value: Any, limit: int = 80) -> str:
    """A value for an error message, cut short: an input value can be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _job(body: Any, line: int, custom_id: str, url: str, api: str, defaults, system) -> Job:
    from pagecli.openai.protocol import ChatCompletionRequest, batch_request

    if not isinstance(body, dict):
        raise RecordError(f"body must be an object, got {json_type(body)}")
    try:
        request = batch_request(url, body)
        params = request.sampling_params(defaults)
    except ValueError as exc:
        raise RecordError(str(exc).splitlines()[0]) from None
    except RecursionError:  # strict mode walks the schema: one nested a thousand deep
        raise RecordError("body.response_format: nested too deeply") from None
    if isinstance(request, ChatCompletionRequest):
        messages = [m.as_template_message() for m in request.messages]
        return Job(line, custom_id, parse_messages(messages, system), params, api)
    try:
        prompts = request.prompts()
    except ValueError as exc:
        raise RecordError(f"body.{exc}") from None
    if len(prompts) != 1:
        raise RecordError("body.prompt: one prompt per batch line (a string or token ids)")
    prompt = prompts[0]
    if not isinstance(prompt, str):
        prompt = {"prompt_token_ids": prompt}
    return Job(line, custom_id, prompt, params, api)


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
