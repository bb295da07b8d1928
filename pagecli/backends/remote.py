"""RemoteBackend: an OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp's llama-server,
`pagecli serve`, a hosted API) over HTTP, with httpx on asyncio.

Chat messages go to /v1/chat/completions; text and token-id prompts to /v1/completions.
Connection errors, 408, 429 and 5xx are retried with jittered exponential backoff (honouring
Retry-After) until the first output of a request has been handed on; any other 4xx is final.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagecli.backends.base import Backend, BackendError, Request, RequestRejected
from pagecli.backends.retry import RetryPolicy, is_retryable_status, parse_retry_after
from pagecli.openai.protocol import sampling_body
from pagecli.outputs import CompletionOutput, RequestOutput, ServerReport

CONNECT_TIMEOUT_S = 10.0
# Servers known to accept vLLM's `return_token_ids` (by the `owned_by` of /v1/models).
TOKEN_ID_SERVERS = ("pagecli", "vllm")


class _Retry(Exception):
    """One attempt failed in a way that may pass: a dropped connection, 408, 429, 5xx."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def base_url(url: str) -> str:
    """The API root of an endpoint URL: `http://host:8000` and `http://host:8000/v1` both give
    `http://host:8000/v1`; any other path is kept as given. BackendError for a bad URL."""
    try:
        parsed = httpx.URL(url.strip())
    except (httpx.InvalidURL, TypeError) as exc:
        raise BackendError(f"{url}: not a URL ({exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise BackendError(f"{url}: not an http(s) URL with a host (e.g. http://host:8000/v1)")
    path = parsed.path.rstrip("/")
    if path == "":
        path = "/v1"
    return str(parsed.copy_with(path=path, query=None, fragment=None))


def error_message(response: httpx.Response) -> str:
    """The server's own words for a failed request: the OpenAI envelope's message, FastAPI's
    detail, or the start of the body."""
    try:
        data = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, httpx.ResponseNotRead):
        data = None
    message = None
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            message = error.get("message")
        elif isinstance(error, str):
            message = error
        message = message or data.get("message") or data.get("detail")
    if not message:
        try:
            message = response.text.strip()[:200]
        except (httpx.ResponseNotRead, UnicodeDecodeError):
            message = ""
    status = f"{response.status_code} {response.reason_phrase}".strip()
    return f"{status}: {message}" if message else status


@dataclass
class _Choice:
    """One sample as it accumulates from a response or from stream chunks."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: Any = None
    delta: str = ""

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            finish_reason=self.finish_reason,
            delta=self.delta,
        )


class _Answer:
    """What a server has said about one request so far."""

    def __init__(self, request: Request, chat: bool, arrival: float) -> None:
        self.request, self.chat = request, chat
        self.choices: dict[int, _Choice] = {}
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.has_token_ids = False
        self.metrics: dict[str, float] = {"arrival_time": arrival}

    def take(self, data: Any, streaming: bool) -> None:
        """Fold in a whole response or one stream chunk; RequestRejected for one whose shape
        is not an OpenAI answer."""
        if not isinstance(data, dict):
            raise RequestRejected("the server's answer is not a JSON object")
        error = data.get("error")
        if error:  # an error event inside a stream, or a 200 that carries an error
            message = error.get("message") if isinstance(error, dict) else error
            raise RequestRejected(f"the server reported an error: {message}")
        if _is_int_list(data.get("prompt_token_ids")):
            self.prompt_token_ids = data["prompt_token_ids"]
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        for c in self.choices.values():
            c.delta = ""
        choices = data.get("choices") or []
        if not isinstance(choices, list):
            raise RequestRejected("the server's answer has no list of choices")
        for raw in choices:
            self._take_choice(raw, streaming)

    def _take_choice(self, raw: Any, streaming: bool) -> None:
        if not isinstance(raw, dict):
            raise RequestRejected("the server's answer has a choice that is not an object")
        index = raw.get("index", 0)
        if not isinstance(index, int) or not 0 <= index < max(1, self.request.params.n):
            raise RequestRejected(f"the server's answer has a choice with index {index!r}")
        choice = self.choices.setdefault(index, _Choice(index))
        if self.chat:
            part = raw.get("delta" if streaming else "message") or {}
            text = part.get("content") if isinstance(part, dict) else None
        else:
            text = raw.get("text")
        if text is not None and not isinstance(text, str):
            raise RequestRejected("the server's answer has a choice whose text is not a string")
        if text:
            choice.text += text
            choice.delta = text
            self.metrics.setdefault("first_token_time", time.perf_counter())
        if _is_int_list(raw.get("token_ids")):
            choice.token_ids += raw["token_ids"]
            self.has_token_ids = True
        if _is_int_list(raw.get("prompt_token_ids")):
            self.prompt_token_ids = raw["prompt_token_ids"]
        if raw.get("logprobs") is not None:
            choice.logprobs = _merge(choice.logprobs, raw["logprobs"])
        if raw.get("finish_reason"):
            choice.finish_reason = raw["finish_reason"]

    def check_complete(self) -> None:
        """RequestRejected for an answer without all `n` choices, each with its finish."""
        n = self.request.params.n
        if len(self.choices) < n:
            got = len(self.choices)
            raise RequestRejected(f"the server answered {got} of the {n} choices asked for")
        if not all(c.finish_reason for c in self.choices.values()):
            raise RequestRejected("the server's answer has a choice without a finish_reason")

    @property
    def done(self) -> bool:
        n = self.request.params.n
        return len(self.choices) >= n and all(c.finish_reason for c in self.choices.values())

    def output(self, finished: bool) -> RequestOutput:
        choices = [self.choices[i] for i in sorted(self.choices)]
        out = RequestOutput(
            self.request.request_id,
            self.request.prompt if isinstance(self.request.prompt, str) else None,
            list(self.prompt_token_ids or []),
            [c.output() for c in choices],
            finished=finished,
            metrics=dict(self.metrics),
        )
        if finished:
            now = time.perf_counter()
            out.metrics.setdefault("first_token_time", now)
            out.metrics["finished_time"] = now
            out.metrics["time_to_first_token"] = (
                out.metrics["first_token_time"] - out.metrics["arrival_time"]
            )
            usage = self.usage or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            num_prompt = usage.get("prompt_tokens")
            if num_prompt is None:
                num_prompt = len(self.prompt_token_ids or [])
            num_completion = usage.get("completion_tokens")
            if num_completion is None:
                num_completion = sum(len(c.token_ids) for c in choices)
            out.num_cached_tokens = int(cached or 0)
            out.server = ServerReport(
                prompt_tokens=int(num_prompt),
                completion_tokens=int(num_completion),
                cached_tokens=None if cached is None else int(cached),
                has_token_ids=self.has_token_ids,
                logprobs=[c.logprobs for c in choices],
            )
        return out


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def _merge(old: Any, new: Any) -> Any:
    """Stream chunks' logprobs joined: the lists of both objects concatenated."""
    if old is None:
        return new
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for key, value in new.items():
            if isinstance(value, list) and isinstance(old.get(key), list):
                merged[key] = old[key] + value
            elif key not in merged or merged[key] is None:
                merged[key] = value
        return merged
    return new


class RemoteBackend(Backend):
    """An OpenAI-compatible endpoint. `start()` lists its models (a refused connection, a bad
    URL or a refused key end there); each request then gets up to `max_retries` retries."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        served_model: str | None = None,
        max_retries: int = 3,
        request_timeout: float = 600.0,
        name: str | None = None,
        retry_policy: RetryPolicy | None = None,
        seed: int | None = None,
    ) -> None:
        self.url = base_url(url)
        self.name = name or self.url
        self.api_key = api_key
        self.model_name = served_model or ""
        self.served_model = served_model
        self.request_timeout = request_timeout
        self.retry = retry_policy or RetryPolicy(max_retries=max_retries)
        self.server_kind: str | None = None  # the `owned_by` of the model, when listed
        self.client: httpx.AsyncClient | None = None
        self._rng = random.Random(seed)

    # ---- connection ----------------------------------------------------------------------

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.url + "/",
            headers=headers,
            timeout=httpx.Timeout(self.request_timeout, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        try:
            response = await self.client.get("models")
        except httpx.HTTPError as exc:
            await self.aclose()
            raise BackendError(f"{self.url}: cannot connect ({_reason(exc)})") from None
        if response.status_code in (401, 403):
            await self.aclose()
            hint = "" if self.api_key else "; give --api-key"
            raise BackendError(
                f"{self.url}: the server refused the request ({error_message(response)}){hint}"
            )
        if response.status_code != 200:
            await self.aclose()
            raise BackendError(
                f"{self.url}: GET /models answered {error_message(response)} (is this the API "
                "root of an OpenAI-compatible server, e.g. http://host:8000/v1?)"
            )
        try:
            data = response.json().get("data")
            models = [m for m in data if isinstance(m, dict)]
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, TypeError):
            await self.aclose()
            raise BackendError(
                f"{self.url}: GET /models did not answer a model list ({response.text[:80]!r})"
            ) from None
        ids = [str(m.get("id")) for m in models if m.get("id") is not None]
        if self.served_model is None:
            if not ids:
                await self.aclose()
                raise BackendError(f"{self.url}: the server lists no model; give --served-model")
            self.model_name = ids[0]
        elif ids and self.served_model not in ids:
            await self.aclose()
            raise BackendError(
                f"{self.url}: the server has no model {self.served_model!r} "
                f"(it serves: {', '.join(ids)})"
            )
        listed = next((m for m in models if m.get("id") == self.model_name), None)
        self.server_kind = str(listed.get("owned_by")) if listed else None

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.url, "server": self.server_kind, "model": self.model_name}

    # ---- requests ------------------------------------------------------------------------

    def request_body(self, request: Request) -> tuple[str, dict[str, Any], bool]:
        """(path, JSON body, whether it is a chat request)."""
        prompt = request.prompt
        chat = isinstance(prompt, list)
        body: dict[str, Any] = {"model": self.model_name}
        if chat:
            body["messages"] = prompt
        elif isinstance(prompt, dict):
            body["prompt"] = list(prompt["prompt_token_ids"])
        else:
            body["prompt"] = prompt
        body.update(sampling_body(request.params, chat))
        if self.server_kind in TOKEN_ID_SERVERS:
            body["return_token_ids"] = True
        if request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return ("chat/completions" if chat else "completions"), body, chat

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if self.client is None:
            raise BackendError(f"{self.url}: not connected")
        path, body, chat = self.request_body(request)
        arrival = time.perf_counter()
        attempt = 0
        while True:
            answer = _Answer(request, chat, arrival)
            yielded = False
            try:
                if request.stream:
                    # aclosing: a caller that stops early closes the HTTP stream now, not at
                    # the event loop's next garbage collection.
                    async with contextlib.aclosing(self._stream(path, body, answer)) as outputs:
                        async for output in outputs:
                            yielded = True
                            yield output
                else:
                    yield await self._post(path, body, answer)
                return
            except _Retry as exc:
                if yielded or attempt >= self.retry.max_retries:
                    tries = f" (after {attempt + 1} tries)" if attempt else ""
                    why = "the connection broke mid-stream: " if yielded else ""
                    raise RequestRejected(f"{why}{exc}{tries}", exc.status) from None
                await asyncio.sleep(self.retry.delay(attempt, exc.retry_after, self._rng))
                attempt += 1

    async def _post(self, path: str, body: dict[str, Any], answer: _Answer) -> RequestOutput:
        try:
            response = await self.client.post(path, json=body)
        except httpx.TransportError as exc:
            raise _Retry(f"connection failed ({_reason(exc)})") from None
        except httpx.HTTPError as exc:  # a body that cannot be decoded, a bad redirect
            raise RequestRejected(f"a bad answer ({_reason(exc)})") from None
        _check(response)
        answer.take(_json_body(response), streaming=False)
        answer.check_complete()
        return answer.output(finished=True)

    async def _stream(
        self, path: str, body: dict[str, Any], answer: _Answer
    ) -> AsyncIterator[RequestOutput]:
        try:
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    _check(response)
                    raise RequestRejected(f"the server answered {error_message(response)}")
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    await response.aread()  # a server that ignored `stream`: a whole answer
                    answer.take(_json_body(response), streaming=False)
                    answer.check_complete()
                    yield answer.output(finished=True)
                    return
                ended = False
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # comments, event names, blank separators
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        ended = True
                        break
                    try:
                        chunk = json.loads(data)
                    except json.JSONDecodeError:
                        raise RequestRejected(
                            f"a stream event is not JSON: {data[:80]!r}"
                        ) from None
                    answer.take(chunk, streaming=True)
                    if any(c.delta for c in answer.choices.values()):
                        yield answer.output(finished=False)
                if not ended and not answer.done:
                    raise _Retry("the server closed the stream before it ended")
        except httpx.TransportError as exc:
            raise _Retry(f"connection failed ({_reason(exc)})") from None
        except httpx.HTTPError as exc:
            raise RequestRejected(f"a bad answer ({_reason(exc)})") from None
        answer.check_complete()
        for choice in answer.choices.values():
            choice.delta = ""
        yield answer.output(finished=True)


def _json_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestRejected(
            f"the server's answer is not JSON: {response.text[:80]!r}", response.status_code
        ) from None


def _check(response: httpx.Response) -> None:
    """Raise for a failed status: _Retry where it may pass, RequestRejected where not."""
    status = response.status_code
    if status < 400:
        return
    message = error_message(response)
    if is_retryable_status(status):
        raise _Retry(message, status, parse_retry_after(response.headers.get("retry-after")))
    raise RequestRejected(message, status)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
