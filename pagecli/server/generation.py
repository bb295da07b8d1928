"""POST /v1/chat/completions and /v1/completions: validate, tokenize, run on the AsyncEngine,
answer as one JSON body or as server-sent events.

A request's outputs come from its own `RequestStream`; the only disconnect logic is an abort
when the handler is cancelled (a streaming client went away) or the client closed the
connection before a non-streaming answer was ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagecli.engine.async_engine import (
    AsyncEngine,
    EngineUnavailable,
    QueueFull,
    RequestFailed,
    RequestStream,
)
from pagecli.errors import GrammarRejected, PromptTooLongError, RequestError
from pagecli.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import StructuredOutputs
from pagecli.server.errors import APIError
from pagecli.server.metrics import ServerMetrics
from pagecli.server.responses import ChoiceState, ReplyParsing, ResponseFormat
from pagecli.server.tool_calls import (
    FORMATS,
    THINK_CLOSE,
    CallFormat,
    Tags,
    auto_grammar,
    call_grammar,
    detect_format,
    detect_reasoning,
    get_format,
)

logger = logging.getLogger("pagecli.server")
RETRY_AFTER_S = "1"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


@dataclass
class _Prompt:
    token_ids: list[int]
    text: str | None


@dataclass
class _Run:
    """One HTTP request's engine requests (a batch of prompts × n samples) and its timing."""

    streams: list[RequestStream]
    arrival: float = field(default_factory=time.perf_counter)
    first_output: float | None = None
    last_output: float | None = None
    gaps: list[float] = field(default_factory=list)
    finals: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> output

    def saw_output(self) -> None:
        now = time.perf_counter()
        if self.first_output is None:
            self.first_output = now
        elif self.last_output is not None:
            self.gaps.append(now - self.last_output)
        self.last_output = now


class GenerationHandler:
    """Runs the two generation endpoints against one AsyncEngine."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        model_names: list[str],
        tool_call_parser: str | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.model_names = model_names
        # the call format of tool calls; None: read from the chat template
        self.tool_call_parser = tool_call_parser
        # Tokenizing off the event loop, one prompt at a time (transformers' fast tokenizers
        # are not meant to be driven from several threads at once).
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagecli-tok")
        # per call format: its tags that are special tokens, and why no grammar can run
        self._tags: dict[str, tuple[Tags, str | None]] = {}

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    # ---- the endpoints -------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        params = self._check(body)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        messages = [m.as_template_message() for m in body.messages]
        tools = [t.as_template_tool() for t in body.tools] if body.tools else None
        call_format, params = await self._tool_calls(body, tools, params)
        tokenizer, limit = self.tokenizer, self._prompt_limit()

        def render() -> tuple[str, list[int]]:
            text = tokenizer.apply_chat_template(messages, True, tools)
            return text, tokenizer.encode(text, limit, add_special_tokens=False)

        try:
            text, ids = await self._in_worker(render)
        except PromptTooLongError as exc:
            raise _too_long(exc, "messages") from None
        except Exception as exc:  # a template that rejects the conversation
            raise APIError(
                400, f"messages: the chat template failed: {exc}", param="messages"
            ) from None
        # a prompt that already closed the think block (thinking turned off) has none to read
        reasoning = detect_reasoning(tokenizer.chat_template) and not text.rstrip().endswith(
            THINK_CLOSE
        )
        fmt = ResponseFormat(
            "chat",
            f"chatcmpl-{uuid.uuid4().hex}",
            body.model or self.model_names[0],
            self.tokenizer,
            reply=ReplyParsing(call_format, tools or [], reasoning)
            if call_format or reasoning
            else None,
        )
        return await self._respond(body, request, [_Prompt(ids, None)], params, fmt)

    async def _tool_calls(self, body: ChatCompletionRequest, tools, params):
        """The call format to read replies in (None: calls are not parsed) and the params:
        with the grammar that forces a call for tool_choice "required" or a named tool, or
        (auto) the one that checks a call once the model opens it; the format's special tags
        kept in the text."""
        choice = body.tool_choice or ("auto" if tools else "none")
        if not tools:
            if choice != "none":
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None, params
        if choice == "none":
            return None, params  # the tools are shown to the model; its reply is text
        template = self.tokenizer.chat_template
        call_format = self.tool_call_parser or detect_format(template)
        if call_format is None:
            raise APIError(
                400,
                "tools: this model's chat template has no tool-call format pagecli can read "
                f"(start the server with --tool-call-parser {'|'.join(FORMATS)})",
                param="tools",
            )
        fmt = get_format(call_format, template)
        tags, no_grammar = await self._format_tags(fmt)
        params = dataclasses.replace(params, keep_token_ids=tuple(sorted(tags.ids.values())))
        parallel = (body.model_extra or {}).get("parallel_tool_calls") is not False
        if choice == "auto":
            if params.structured is not None or no_grammar:
                return fmt, params  # the request's own constraint rules the reply, or none can
            grammar = auto_grammar(fmt, tools, parallel, tags)
            checked = dataclasses.replace(params, structured=StructuredOutputs(grammar=grammar))
            try:  # compiled here (and cached for the request): a tool schema the compiler
                await self.engine.compile_grammar(checked)  # lacks must not fail an auto reply
            except GrammarRejected as exc:
                logger.warning("tool_choice auto: calls are parsed, not checked (%s)", exc)
                return fmt, params
            return fmt, checked
        if params.structured is not None:
            raise APIError(
                400,
                "tool_choice required or a named tool forces a call: it cannot be combined "
                "with response_format or structured_outputs",
                param="tool_choice",
            )
        if no_grammar:
            raise APIError(400, f"tool_choice: {no_grammar}", param="tool_choice")
        try:
            grammar = call_grammar(fmt, tools, body.tool_choice_name(), parallel, tags)
        except ValueError as exc:
            raise APIError(400, f"tool_choice: {exc}", param="tool_choice") from None
        return fmt, dataclasses.replace(params, structured=StructuredOutputs(grammar=grammar))

    async def _format_tags(self, fmt: CallFormat) -> tuple[Tags, str | None]:
        """The format's tags that this model's vocabulary holds as special tokens, and why no
        grammar can run on it (None: one can). Looked up once per format, off the event loop
        (the first builds llguidance's view of the vocabulary)."""
        found = self._tags.get(fmt.name)
        if found is None:
            lookup = self.engine.engine.special_token_ids
            try:
                found = Tags(await self._in_worker(lookup, list(fmt.tags))), None
            except GrammarRejected as exc:  # a tokenizer llguidance cannot read
                found = Tags(), str(exc)
            self._tags[fmt.name] = found
        return found

    async def completion(self, body: CompletionRequest, request: Request) -> Response:
        params = self._check(body)
        try:
            raw_prompts = body.prompts()
        except ValueError as exc:
            raise APIError(400, f"prompt: {exc}", param="prompt") from None
        prompts = []
        for raw in raw_prompts:
            if isinstance(raw, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", "prompt")
                try:
                    ids = await self._in_worker(self.tokenizer.encode, raw, self._prompt_limit())
                except PromptTooLongError as exc:
                    raise _too_long(exc, "prompt") from None
                prompts.append(_Prompt(ids, raw))
            else:
                prompts.append(_Prompt(list(raw), None))
        fmt = ResponseFormat(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            body.model or self.model_names[0],
            self.tokenizer,
        )
        return await self._respond(body, request, prompts, params, fmt)

    # ---- shared steps --------------------------------------------------------------------

    def _check(self, body: ChatCompletionRequest | CompletionRequest):
        unsupported = body.unsupported_field()
        if unsupported:
            raise APIError(400, f"{unsupported} is not supported by this server", param=unsupported)
        unknown = body.unknown_fields()
        if unknown:
            logger.warning("ignoring unknown request field(s): %s", ", ".join(unknown))
        if body.model is not None and body.model not in self.model_names:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server has "
                f"{', '.join(repr(n) for n in self.model_names)}",
                param="model",
                code="model_not_found",
            )
        try:
            return body.sampling_params()
        except ValueError as exc:
            message = str(exc)
            param = message.split()[0].rstrip(":,.") if message else None
            raise APIError(400, message, param=param) from None

    def _prompt_limit(self) -> int:
        """The most tokens a prompt can have: text past it is refused from a prefix."""
        core = self.engine.engine
        return min(core.max_model_len, core.capacity_tokens)

    async def _in_worker(self, func: Callable, *args: Any):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, func, *args)

    async def _compile(self, body, params):
        """The request's output constraint, compiled off the event loop under the server's
        time limit; a 400 naming the field that set it when it cannot run."""
        try:
            return await self.engine.compile_grammar(params)
        except GrammarRejected as exc:
            extra = body.model_extra or {}
            field = next(
                (n for n in ("response_format", "structured_outputs") if extra.get(n)),
                "tool_choice" if getattr(body, "tools", None) else "structured_outputs",
            )
            raise APIError(400, f"{field}: {exc}", param=field) from None
        except EngineUnavailable as exc:
            raise APIError(
                503, str(exc), code="unavailable", headers={"Retry-After": RETRY_AFTER_S}
            ) from None

    def _start(self, prompts: list[_Prompt], params, fmt: ResponseFormat, grammar=None) -> _Run:
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(
                    self.engine.add_request(
                        f"{fmt.response_id}-{i}",
                        prompt.token_ids,
                        params,
                        prompt.text,
                        grammar=grammar,
                    )
                )
        except BaseException as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(exc, RequestError):
                raise APIError(
                    400,
                    str(exc),
                    param="messages" if fmt.kind == "chat" else "prompt",
                    code="context_length_exceeded",
                ) from None
            if isinstance(exc, QueueFull):
                raise APIError(
                    503, str(exc), code="queue_full", headers={"Retry-After": RETRY_AFTER_S}
                ) from None
            if isinstance(exc, EngineUnavailable):
                raise APIError(
                    503, str(exc), code="unavailable", headers={"Retry-After": RETRY_AFTER_S}
                ) from None
            raise
        return _Run(streams)

    def _abort(self, run: _Run) -> None:
        for stream in run.streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)

    def _record(self, request: Request, run: _Run) -> dict[str, int]:
        usage = _usage(run)
        outputs = [c for out in run.finals.values() for c in out.outputs]
        end = run.last_output or time.perf_counter()
        self.metrics.observe_request(
            usage["prompt_tokens"],
            usage["completion_tokens"],
            [c.finish_reason or "abort" for c in outputs],
            None if run.first_output is None else run.first_output - run.arrival,
            run.gaps,
            end - run.arrival,
        )
        request.state.usage = usage  # for the access log
        return usage

    async def _respond(
        self, body, request: Request, prompts: list[_Prompt], params, fmt: ResponseFormat
    ) -> Response:
        grammar = await self._compile(body, params)
        run = self._start(prompts, params, fmt, grammar)
        if body.stream:
            return _DisconnectAwareStream(
                self._sse(run, body, request, params.n, fmt),
                on_close=lambda: self._abort(run),
                media_type="text/event-stream",
            )
        try:
            finished = await _unless_disconnected(request, self._collect(run))
        finally:
            self._abort(run)
        if not finished:
            return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody is there to read it
        usage = self._record(request, run)
        choices = []
        for i in range(len(prompts)):
            final = run.finals[i]
            ids = final.prompt_token_ids if body.return_token_ids else None
            for c in final.outputs:
                choices.append(fmt.full_choice(i * params.n + c.index, c, ids))
        return JSONResponse(fmt.full_response(choices, usage))

    async def _collect(self, run: _Run) -> None:
        async def one(index: int, stream: RequestStream) -> None:
            async for output in stream:
                run.saw_output()
                if output.finished:
                    run.finals[index] = output

        try:
            await asyncio.gather(*(one(i, s) for i, s in enumerate(run.streams)))
        except RequestFailed as exc:
            raise APIError(500, str(exc)) from None

    async def _sse(
        self, run: _Run, body, request: Request, n: int, fmt: ResponseFormat
    ) -> AsyncIterator[bytes]:
        include_usage = body.include_usage
        states: dict[int, ChoiceState] = {}
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except RequestFailed as exc:
                queue.put_nowait((index, exc))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(run.streams)]
        try:
            for i in range(len(run.streams)):
                for k in range(n):
                    states[i * n + k] = ChoiceState()
                    first = fmt.first_chunk(i * n + k)
                    if first is not None:
                        yield _event(fmt.chunk([first], include_usage))
            remaining = len(run.streams)
            while remaining:
                index, output = await queue.get()
                if isinstance(output, RequestFailed):
                    yield _event(fmt.error_event(str(output)))
                    return
                run.saw_output()
                choices = []
                for c in output.outputs:
                    choice = fmt.delta_choice(
                        index * n + c.index, c, states[index * n + c.index], body.return_token_ids
                    )
                    if choice is not None:
                        choices.append(choice)
                if choices:
                    yield _event(fmt.chunk(choices, include_usage))
                if output.finished:
                    run.finals[index] = output
                    remaining -= 1
            usage = self._record(request, run)
            if include_usage:
                yield _event(fmt.usage_chunk(usage))
            yield b"data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            self._abort(run)


def _too_long(exc: PromptTooLongError, param: str) -> APIError:
    return APIError(
        400, f"{exc}: it does not fit the context", param=param, code="context_length_exceeded"
    )


def _usage(run: _Run) -> dict[str, Any]:
    outputs = list(run.finals.values())
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[None]) -> bool:
    """Await `work`; if the client closes the connection first, cancel it and return False
    (the caller's `finally` aborts the engine requests)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task in done:
        task.result()
        return True
    return False


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _DisconnectAwareStream(StreamingResponse):
    """A streaming response that always watches for the client going away, and then cancels
    the body iterator at once; `on_close` runs however it ends (even if the client left
    before the first chunk, when the iterator's own `finally` never runs)."""

    def __init__(self, content, on_close: Callable[[], None], **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
