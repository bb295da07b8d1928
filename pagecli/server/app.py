"""The OpenAI-compatible HTTP app of `pagecli serve` (FastAPI): routes, the API key, the body
size limit and the access log. Route functions stay thin; the generation endpoints live in
generation.py, the request shapes in ../openai/protocol.py, the answers in responses.py, the
envelope in errors.py."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagecli import __version__
from pagecli.engine.async_engine import AsyncEngine, EngineState, EngineUnavailable
from pagecli.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagecli.server import errors
from pagecli.server.errors import APIError, envelope
from pagecli.server.generation import GenerationHandler
from pagecli.server.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("pagecli.server")
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass
class ServerSettings:
    """What the HTTP layer needs beyond the engine."""

    model_names: list[str]  # names a request may give as `model`; the first is reported
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    allowed_origins: list[str] = field(default_factory=list)
    access_log: Callable[[str], None] | None = None  # one line per request, when set
    tool_call_parser: str | None = None  # the tool-call format; None: from the chat template


def create_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The app, serving `engine` (which may still be loading: /health says so)."""
    app = FastAPI(
        title="pagecli", version=__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    metrics = ServerMetrics(settings.model_names[0])
    handler = GenerationHandler(engine, metrics, settings.model_names, settings.tool_call_parser)
    errors.install(app)
    app.state.engine, app.state.metrics = engine, metrics

    def ready_engine():
        if engine.state is not EngineState.READY:
            raise APIError(
                503, engine.unavailable_reason(), code="unavailable", headers={"Retry-After": "1"}
            )
        return engine.engine

    @app.get("/health")
    async def health() -> Response:
        if engine.state is EngineState.READY:
            return Response(status_code=200)
        return JSONResponse(envelope(503, engine.unavailable_reason()), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        try:
            stats = await engine.stats()
        except EngineUnavailable:
            stats = None
        return Response(metrics.render(stats), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats_route() -> dict:
        """The engine's stats snapshot as JSON: blocks, requests, rates, the kernel settings
        in effect (what chat's /stats and bench --json show)."""
        try:
            stats = await engine.stats()
        except EngineUnavailable:
            raise APIError(503, engine.unavailable_reason()) from None
        return stats.as_dict()

    @app.get("/v1/models")
    async def models() -> dict:
        core = engine.engine
        max_len = core.max_model_len if core is not None else None
        root = str(core.source.path) if core is not None else None
        created = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagecli",
                "root": root,
                "parent": None,
                "max_model_len": max_len,
            }
            for name in settings.model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        ready_engine()
        return await handler.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ready_engine()
        return await handler.completion(body, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        core = ready_engine()
        tok = _tokenizer(core)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            messages = [m.as_template_message() for m in body.messages]
            ids = tok.encode_chat(messages, body.add_generation_prompt)
        elif body.add_special_tokens:
            ids = tok.encode(body.prompt)
        else:
            ids = tok.hf.encode(body.prompt, add_special_tokens=False)
        return {"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        core = ready_engine()
        vocab = core.hf_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary", param="tokens")
        return {"prompt": _tokenizer(core).decode(body.tokens, skip_special_tokens=False)}

    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        app.add_middleware(ApiKey, api_key=settings.api_key)
    if settings.access_log is not None:
        app.add_middleware(AccessLog, write=settings.access_log)
    return app


def _tokenizer(core):
    if core.tokenizer is None:
        raise APIError(400, f"{core.source.name} has no tokenizer")
    return core.tokenizer


async def _send_error(
    send,
    status: int,
    message: str,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(envelope(status, message, code=code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ApiKey:
    """401 unless `Authorization: Bearer KEY`; /health and /metrics stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "a valid API key is required (Authorization: Bearer KEY)"
            return await _send_error(
                send,
                401,
                message,
                code="invalid_api_key",
                headers=[(b"www-authenticate", b"Bearer")],
            )
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body over `max_bytes`, counted as it arrives (chunked bodies too), before
    the app sees any of it."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(message)
            if not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        replay = [{"type": "http.request", "body": body, "more_body": False}]
        replay += [m for m in chunks if m["type"] != "http.request"]

        async def replayed():
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)

    async def _too_large(self, send) -> None:
        await _send_error(
            send, 413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large"
        )


class AccessLog:
    """One line per request once its response has ended: method, path, status, the prompt,
    completion and cached tokens, and seconds."""

    def __init__(self, app, write: Callable[[str], None]) -> None:
        self.app, self.write = app, write

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def tracking_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            usage = scope.get("state", {}).get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.write(
                f"{scope['method']} {scope['path']} {status[0]} "
                f"prompt={usage.get('prompt_tokens', 0)} "
                f"completion={usage.get('completion_tokens', 0)} cached={cached} "
                f"{time.perf_counter() - start:.3f}s"
            )
