"""LocalBackend: the in-process engine, through the async front (engine/async_engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pagecli.backends.base import Backend, BackendError, EngineFailed, Request, RequestRejected
from pagecli.config import EngineConfig
from pagecli.engine.async_engine import (
    AsyncEngine,
    EngineState,
    EngineUnavailable,
    RequestFailed,
)
from pagecli.engine.llm_engine import RequestError
from pagecli.engine.prompts import PromptEncoder
from pagecli.outputs import RequestOutput

LOAD_POLL_S = 0.05


class LocalBackend(Backend):
    """The model loaded in this process. `start()` raises what loading raised (the CLI turns
    it into one line); requests are tokenized here and run on the engine thread."""

    def __init__(self, config: EngineConfig, name: str = "pagecli") -> None:
        self.config = config
        self.name = name
        self.model_name = config.model or "the default model"
        self.async_engine = AsyncEngine(config)
        self.encoder: PromptEncoder | None = None

    async def start(self) -> None:
        """Load the model on the engine thread; a cancel (Ctrl-C) stops waiting at once."""
        self.async_engine.start()
        while not self.async_engine.ready.is_set():
            await asyncio.sleep(LOAD_POLL_S)
        if self.async_engine.state is not EngineState.READY:
            raise self.async_engine.load_exception or BackendError(
                self.async_engine.unavailable_reason()
            )
        self.engine = self.async_engine.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.source.name
        self.encoder = PromptEncoder(self.engine)

    async def aclose(self) -> None:
        """Abort what runs and end the engine thread; one still loading is left to finish on
        its own (a daemon thread), so closing never waits for a load."""
        if not self.async_engine.ready.is_set():
            self.async_engine.stop(timeout=0)
            return
        await asyncio.get_running_loop().run_in_executor(None, self.async_engine.stop)

    def encode(self, request: Request) -> tuple[list[int], str | None]:
        """The request's prompt as token ids (and its text, when it has one)."""
        try:
            return self.encoder.encode_prompt(request.prompt)
        except ValueError as exc:  # RequestError too: too long, found before tokenizing it all
            raise RequestRejected(str(exc)) from None
        except Exception as exc:  # a chat template can reject a conversation in any way
            raise RequestRejected(f"cannot build the prompt: {_first_line(exc)}") from None

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        token_ids, text = self.encode(request)
        try:
            grammar = await self.async_engine.compile_grammar(request.params)
            stream = self.async_engine.add_request(
                request.request_id,
                token_ids,
                request.params,
                text,
                final_only=not request.stream,
                grammar=grammar,
            )
        except EngineUnavailable as exc:
            raise EngineFailed(str(exc)) from None
        except (RequestError, ValueError) as exc:
            raise RequestRejected(str(exc), num_prompt_tokens=len(token_ids)) from None
        try:
            async for output in stream:
                yield output
        except RequestFailed as exc:
            raise EngineFailed(str(exc)) from None
        except ValueError as exc:  # the engine refused it when it arrived there
            raise RequestRejected(str(exc), num_prompt_tokens=len(token_ids)) from None
        finally:
            if not stream.finished:
                self.async_engine.abort(request.request_id)

    async def stats(self):
        return await self.async_engine.stats()

    def describe(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "backend": "in-process",
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
        }


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
