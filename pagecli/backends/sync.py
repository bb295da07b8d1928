"""SyncBackend: a Backend driven from synchronous code (the chat REPL and its piped mode),
on an event loop of its own."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from pagecli.backends.base import Backend, Prompt, Request
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import SamplingParams

POLL_S = 0.1  # how often a waiting stream looks at its stop flag


class SyncBackend:
    """Blocking calls over a Backend. Offers what ChatSession needs of an LLM (`tokenizer`,
    `encode_text`, `prompt_limit`, `stream`) where the backend has a tokenizer."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self._ids = itertools.count()
        self.stop_asked: Callable[[], bool] = lambda: False  # set while a turn may be stopped

    # ---- life --------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop.run_until_complete(self.backend.start())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.backend.aclose())
        self.loop.close()

    # ---- what the backend is ----------------------------------------------------------------

    @property
    def engine(self) -> Any:
        return self.backend.engine

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    @property
    def model_name(self) -> str:
        return self.backend.model_name

    @property
    def is_local(self) -> bool:
        return self.backend.is_local

    def stats(self):
        """The local engine's EngineStats, taken between steps; None for a remote server."""
        return self.loop.run_until_complete(self.backend.stats())

    def prompt_limit(self) -> tuple[int, str]:
        return self.backend.encoder.prompt_limit()

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encoder.encode_text(text, add_special_tokens)

    # ---- requests ------------------------------------------------------------------------

    @contextlib.contextmanager
    def stoppable(self, stop_asked: Callable[[], bool]) -> Iterator[None]:
        """While active, a stream that waits for its next output gives up once `stop_asked()`."""
        previous, self.stop_asked = self.stop_asked, stop_asked
        try:
            yield
        finally:
            self.stop_asked = previous

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's outputs as text arrives; ends early (without a finished
        output) when the stop flag is raised while waiting. Closing it aborts the request."""
        request = Request(
            f"chat-{next(self._ids)}", prompt, sampling_params or SamplingParams(), stream=True
        )
        outputs = self.backend.generate(request)
        task = None
        try:
            while True:
                task = self.loop.create_task(outputs.__anext__())
                while not task.done():
                    self.loop.run_until_complete(asyncio.wait({task}, timeout=POLL_S))
                    if not task.done() and self.stop_asked():
                        return
                try:
                    output = task.result()
                except StopAsyncIteration:
                    return
                task = None
                yield output
                if output.finished:
                    return
        finally:
            if task is not None and not task.done():
                task.cancel()
                self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            with contextlib.suppress(RuntimeError, StopAsyncIteration):
                self.loop.run_until_complete(outputs.aclose())
