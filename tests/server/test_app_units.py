"""The HTTP app in-process (no model): engine states, the 500 envelope, protocol mapping."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from pagecli.config import EngineConfig
from pagecli.engine.async_engine import AsyncEngine, EngineState
from pagecli.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagecli.server.app import ServerSettings, create_app
from pagecli.server.generation import GenerationHandler

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}


def _call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kw)

    return asyncio.run(go())


def _app(state: EngineState):
    engine = AsyncEngine(EngineConfig())  # never started: no model is loaded
    engine.state = state
    return create_app(engine, ServerSettings(model_names=["m"]))


@pytest.mark.parametrize(
    ("state", "words"),
    [
        (EngineState.LOADING, "loading"),
        (EngineState.DRAINING, "shutting down"),
        (EngineState.DEAD, "stopped"),
    ],
)
def test_not_ready_states_are_503(state, words):
    app = _app(state)
    health = _call(app, "GET", "/health")
    assert health.status_code == 503 and words in health.json()["error"]["message"]
    chat = _call(app, "POST", "/v1/chat/completions", json=CHAT_BODY)
    assert chat.status_code == 503 and chat.headers["retry-after"] == "1"
    assert words in chat.json()["error"]["message"]
    assert _call(app, "GET", "/metrics").status_code == 200
    stats = _call(app, "GET", "/stats")
    assert stats.status_code == 503 and words in stats.json()["error"]["message"]


def test_an_internal_error_is_a_500_envelope_and_the_traceback_goes_to_the_log(monkeypatch, caplog):
    async def broken(self, body, request):
        raise RuntimeError("secret internals at line 42")

    monkeypatch.setattr(GenerationHandler, "chat", broken)
    app = _app(EngineState.READY)
    with caplog.at_level(logging.ERROR, logger="pagecli.server"):
        response = _call(app, "POST", "/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "Traceback" not in response.text
    assert "secret internals" not in response.text
    assert any(r.exc_info and "secret internals" in str(r.exc_info[1]) for r in caplog.records)


def test_sampling_fields_map_onto_sampling_params():
    chat = ChatCompletionRequest(
        **CHAT_BODY,
        max_completion_tokens=9,
        max_tokens=3,
        temperature=0.5,
        top_k=4,
        stop="x",
        logprobs=True,
        top_logprobs=2,
        seed=1,
        n=2,
        ignore_eos=True,
    )
    p = chat.sampling_params()
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.logprobs, p.seed, p.n) == (
        9,
        0.5,
        4,
        ["x"],
        2,
        1,
        2,
    )
    assert p.ignore_eos
    assert ChatCompletionRequest(**CHAT_BODY).sampling_params().max_tokens is None
    assert ChatCompletionRequest(**CHAT_BODY).sampling_params().logprobs is None
    assert CompletionRequest(prompt="a").sampling_params().max_tokens == 16
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(**CHAT_BODY, top_logprobs=2).sampling_params()


def test_prompt_forms():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    with pytest.raises(ValueError):
        CompletionRequest(prompt=[]).prompts()


def test_unsupported_and_unknown_fields():
    # tools are a chat feature; the legacy endpoint refuses them, and the old `functions`
    assert CompletionRequest(prompt="a", tools=[{"type": "function"}]).unsupported_field() == (
        "tools"
    )
    assert ChatCompletionRequest(**CHAT_BODY, functions=[{"name": "f"}]).unsupported_field() == (
        "functions"
    )
    assert ChatCompletionRequest(**CHAT_BODY, tools=None).unsupported_field() is None
    assert (
        ChatCompletionRequest(**CHAT_BODY, response_format={"type": "text"}).unsupported_field()
        is None
    )
    assert CompletionRequest(prompt="a", best_of=3).unsupported_field() == "best_of"
    assert CompletionRequest(prompt="a", echo=True).unsupported_field() == "echo"
    request = ChatCompletionRequest(**CHAT_BODY, user="u", zzz=1, aaa=2)
    assert request.unsupported_field() is None
    assert request.unknown_fields() == ["aaa", "zzz"]
