"""The request interface that `generate`, `chat` and `bench` are written against.

A `Backend` runs requests and streams back `RequestOutput`s (pagecli.outputs), whatever does
the work: the in-process engine (local.py, through the async front) or an OpenAI-compatible
server (remote.py, over HTTP). Callers never ask which one it is; they ask what it can do
(`tokenizer`, `engine`) and read what it reports.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Union

from pagecli.errors import BackendError, RequestRejected
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import SamplingParams

# A prompt: text, chat messages, or {"prompt_token_ids": [...]} (as LLM.generate takes).
Prompt = Union[str, list[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Request:
    """One request: an id unique among the backend's running requests, a prompt, and how to
    sample. `stream` asks for outputs as text arrives (else one output at the end)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: bool = False


class EngineFailed(BackendError):
    """The in-process engine died while requests ran."""


class Backend(abc.ABC):
    """Runs requests for one model. Open with `start()` and close with `aclose()`, both from
    the event loop that will use it."""

    name: str  # what tables and messages call it: "pagecli", a URL, or NAME from NAME=URL
    model_name: str  # the model, as output records name it

    #: The tokenizer, where this process has one (the local engine); chat needs it for
    #: token-exact turns and /prompt.
    tokenizer: Any = None

    #: The in-process LLMEngine, where there is one; /blocks, the block display and the
    #: toolbar read it. None for a remote server.
    engine: Any = None

    @property
    def is_local(self) -> bool:
        return self.engine is not None

    @abc.abstractmethod
    async def start(self) -> None:
        """Load or connect; raises BackendError with the reason."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Abort what runs and release the engine or the connections."""

    @abc.abstractmethod
    def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Run one request: its outputs in order, the last with `finished` set (only that one
        unless `request.stream`). Raises RequestRejected for this request, BackendError
        when the backend itself is gone. Closing the iterator early aborts the request."""

    async def complete(self, request: Request) -> RequestOutput:
        """Run one request to its end and return the final output."""
        final = None
        stream = self.generate(request)
        try:
            async for output in stream:
                final = output
        finally:
            await stream.aclose()
        if final is None:
            raise RequestRejected("the request ended without an answer")
        return final

    async def stats(self):
        """An EngineStats snapshot of the local engine; None for a remote server."""
        return None

    def describe(self) -> dict[str, Any]:
        """Facts for a bench report: at least where it runs."""
        return {"backend": self.name}
