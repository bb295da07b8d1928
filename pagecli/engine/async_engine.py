"""AsyncEngine: the engine loop on its own thread, fed and read from asyncio.

One thread owns the `LLMEngine`: it loads the model, then loops: take the commands that
arrived (add, abort, stats), run one step while there is work, hand each request's outputs to
its `RequestStream`. It blocks only on its command queue, and only when it has nothing to run.
The asyncio side never waits on a step: `add_request` and `abort` are thread-safe and return
at once, and every output reaches its request's own queue through `call_soon_threadsafe`.

This is the front that `pagecli serve` uses; detokenization and stop strings stay in
`LLMEngine`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pagecli.config import EngineConfig
from pagecli.engine.llm_engine import LLMEngine
from pagecli.engine.stats import EngineStats
from pagecli.engine.structured import CompiledGrammar
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import SamplingParams

logger = logging.getLogger("pagecli.engine")

_ENGINES: weakref.WeakSet = weakref.WeakSet()  # every AsyncEngine of this process


def engine_at_work() -> bool:
    """Whether an engine thread of this process is loading a model or has requests to run:
    it may be inside torch's C++ when the process exits (cli/app.py's exit)."""
    return any(engine.at_work for engine in list(_ENGINES))


class EngineState(str, enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # shutting down: no new requests, the running ones go on
    DEAD = "dead"  # loading failed or a step raised
    STOPPED = "stopped"


class EngineUnavailable(RuntimeError):
    """The engine takes no new request (loading, shutting down or dead)."""


class QueueFull(RuntimeError):
    """The waiting queue holds `max_queued_requests` already."""


class RequestFailed(RuntimeError):
    """The engine died while this request ran."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    grammar: CompiledGrammar | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    """Run `func(engine)` on the engine thread between steps; its result goes to `future`."""

    func: Callable[[LLMEngine], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Fatal:
    """The engine cannot go on (a tensor-parallel worker died between steps)."""

    error: BaseException


_STOP = object()


@dataclass(frozen=True)
class _Entry:
    """A request's stream, the event loop that reads it, and whether it wants every output."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    final_only: bool


class RequestStream:
    """The outputs of one request, in order; iterate with `async for`. The last one has
    `finished` set. Raises RequestFailed when the engine died before the request ended."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    """An `LLMEngine` running on its own thread, shared by many asyncio tasks.

    `start()` begins loading in the background (`state` is LOADING until it is READY or
    DEAD). `max_queued_requests` bounds the requests admitted but not yet running; past it
    `add_request` raises QueueFull.
    """

    def __init__(self, config: EngineConfig, max_queued_requests: int | None = None) -> None:
        self.config = config
        self.max_queued_requests = max_queued_requests
        self.engine: LLMEngine | None = None
        self.state = EngineState.LOADING
        self.error: str | None = None  # why the engine is DEAD
        self.load_exception: BaseException | None = None  # what loading raised, if it failed
        self.step_exception: BaseException | None = None  # what a step raised, if one did
        self.ready = threading.Event()  # set once loading ended, either way
        self.num_running = 0  # published by the engine thread after every step
        self.num_waiting = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Entry] = {}
        self._lock = threading.Lock()  # guards _streams and the counts of pending adds
        self._pending_adds = 0
        self._thread = threading.Thread(target=self._run, name="pagecli-engine", daemon=True)
        _ENGINES.add(self)

    # ---- the asyncio side ----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def at_work(self) -> bool:
        """The engine thread runs and is loading, or has unfinished requests."""
        return self._thread.is_alive() and (
            self.state is EngineState.LOADING or self.num_unfinished > 0
        )

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        final_only: bool = False,
        grammar: CompiledGrammar | None = None,
    ) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream (only the finished one
        with `final_only`). Raises EngineUnavailable, QueueFull, or the engine's RequestError
        for a request that can never run. Call it from the event loop that will read the
        stream. A structured request passes its `grammar` from `compile_grammar` (else the
        engine thread compiles it, holding up every step meanwhile)."""
        if self.state is not EngineState.READY:
            raise EngineUnavailable(self.unavailable_reason())
        self.engine.check_request(prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id)
        with self._lock:
            queued = self.num_waiting + self._pending_adds
            if self.max_queued_requests is not None and queued >= self.max_queued_requests:
                raise QueueFull(f"the waiting queue is full ({self.max_queued_requests} requests)")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = _Entry(stream, loop, final_only)
            self._pending_adds += 1
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, prompt, grammar))
        return stream

    async def compile_grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's structured-output constraint compiled off the event loop and off
        the engine thread (None when it has none); GrammarRejected says why it cannot run."""
        if params.structured is None:
            return None
        if self.state is not EngineState.READY:
            raise EngineUnavailable(self.unavailable_reason())
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.compile_grammar, params.structured)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are released before the next step. Safe from any
        thread, and for a request that has already finished."""
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._commands.put(_Abort(request_id))

    async def call(self, func: Callable[[LLMEngine], Any]) -> Any:
        """Run `func(engine)` on the engine thread between two steps and return its result."""
        if self.state in (EngineState.LOADING, EngineState.DEAD, EngineState.STOPPED) or (
            not self._thread.is_alive()
        ):
            raise EngineUnavailable(self.unavailable_reason())
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Call(func, future, loop))
        return await future

    async def stats(self) -> EngineStats:
        """A snapshot of the engine, taken between steps."""
        return await self.call(lambda engine: engine.stats())

    def drain(self) -> None:
        """Take no new requests; the running ones go on."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left and end the engine thread (waiting at most `timeout` seconds;
        a thread still loading ends once the load is done)."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING
        self._commands.put(_STOP)
        if self._thread.is_alive() and timeout != 0:
            self._thread.join(timeout)

    def unavailable_reason(self) -> str:
        """Why the engine takes no new request now (for errors and /health)."""
        return {
            EngineState.LOADING: "the model is still loading",
            EngineState.DRAINING: "the server is shutting down",
            EngineState.DEAD: f"the engine stopped: {self.error}",
            EngineState.STOPPED: "the engine has stopped",
        }.get(self.state, "the engine is not ready")

    # ---- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
        except BaseException as exc:  # noqa: BLE001 - reported through `state` and `error`
            self.error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            self.state = EngineState.DEAD
            self.load_exception = exc
            self.ready.set()
            return
        parallel = self.engine.executor.parallel
        if parallel is not None:
            parallel.on_failure(lambda error: self._commands.put(_Fatal(error)))
        self.state = EngineState.READY
        self.ready.set()
        try:
            while self._take_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                self.num_running = len(self.engine.scheduler.running)
                self.num_waiting = len(self.engine.scheduler.waiting)
        except Exception as exc:
            from pagecli.engine.parallel import WorkerFailed

            if not isinstance(exc, WorkerFailed):  # that one is a known cause: no traceback
                logger.exception("the engine step failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.step_exception = exc
            self.state = EngineState.DEAD
            self._fail_all(RequestFailed(f"the engine stopped: {self.error}"))
            self.engine.close()
            return
        self._fail_all(RequestFailed("the engine has stopped"))
        self.engine.close()
        self.state = EngineState.STOPPED

    def _take_commands(self, block: bool) -> bool:
        """Apply the queued commands; wait for one when `block`. False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is _STOP:
                self.engine.abort_all()
                return False
            if isinstance(command, _Fatal):
                raise command.error
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            with self._lock:
                self._pending_adds -= 1
                entry = self._streams.get(command.request_id)
            if entry is None:  # aborted before it reached the engine
                return
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.prompt,
                    command.grammar,
                )
            except ValueError as exc:
                with self._lock:
                    self._streams.pop(command.request_id, None)
                entry.loop.call_soon_threadsafe(entry.stream._put, exc)
        elif isinstance(command, _Abort):
            engine.abort_request(command.request_id)
        else:
            try:
                result = command.func(engine)
            except Exception as exc:
                command.loop.call_soon_threadsafe(_settle, command.future, None, exc)
            else:
                command.loop.call_soon_threadsafe(_settle, command.future, result, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                entry = self._streams.get(output.request_id)
                if entry is None:
                    continue  # aborted by its client
                if output.finished:
                    del self._streams[output.request_id]
                elif entry.final_only:
                    continue
                by_loop.setdefault(entry.loop, []).append((entry.stream, output))
        for loop, items in by_loop.items():  # one wake-up of each event loop per step
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, error: BaseException) -> None:
        """End every stream and pending call with `error` (the engine thread is ending)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Call):
                command.loop.call_soon_threadsafe(_settle, command.future, None, error)
        with self._lock:
            entries = list(self._streams.values())
            self._streams.clear()
        for entry in entries:
            try:
                entry.loop.call_soon_threadsafe(entry.stream._put, error)
            except RuntimeError:  # that event loop is closed already
                pass


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._put(output)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
