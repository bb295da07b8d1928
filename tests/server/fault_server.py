"""A small OpenAI-compatible ASGI app that misbehaves on purpose, served by uvicorn on
loopback in a thread of the test process, so tests can count and time the attempts.

What a completion request gets depends on its prompt (text, or the first message's text):
- "flaky...": 503 with Retry-After twice, then an answer;
- "bad...": 400 with the OpenAI error envelope, every time;
- "deny...": 401, every time;
- "throttle...": 429 without Retry-After once, then an answer;
- "malformed...": a 200 whose choices are [null];
- "cut...": the response starts, half the body is sent, then the connection is dropped;
- "cutstream...": (streaming) one chunk, then the connection is dropped;
- "dropfirst...": (streaming) dropped before any chunk once, then a whole stream;
- "slow...": an answer after SLOW_S seconds (streaming: the headers at once, then silence);
- anything else: an answer, " echo: <prompt>".
Under /locked/v1 every request needs `Authorization: Bearer good`, else 401.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import defaultdict

import uvicorn

RETRY_AFTER_S = 2
SLOW_S = 60


class FaultApp:
    def __init__(self) -> None:
        self.attempts: dict[str, list[float]] = defaultdict(list)  # prompt -> monotonic times
        self.lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = dict(scope["headers"])
        if path.startswith("/locked/"):
            if headers.get(b"authorization") != b"Bearer good":
                await _json(send, 401, {"error": {"message": "bad key", "type": "auth"}})
                return
            path = path[len("/locked") :]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path == "/v1/models":
            await _json(send, 200, {"data": [{"id": "fault-model", "owned_by": "tests"}]})
            return
        if path not in ("/v1/completions", "/v1/chat/completions"):
            await _json(send, 404, {"error": {"message": f"no route {path}"}})
            return
        request = json.loads(body)
        chat = path.endswith("chat/completions")
        prompt = request["messages"][-1]["content"] if chat else request["prompt"]
        key = json.dumps(prompt)
        with self.lock:
            self.attempts[key].append(time.monotonic())
            count = len(self.attempts[key])
        text = str(prompt)
        if text.startswith("flaky") and count <= 2:
            await _json(
                send,
                503,
                {"error": {"message": "busy", "type": "server_error"}},
                [(b"retry-after", str(RETRY_AFTER_S).encode())],
            )
        elif text.startswith("deny"):
            await _json(send, 401, {"error": {"message": "this key may not do that"}})
        elif text.startswith("throttle") and count == 1:
            await _json(send, 429, {"error": {"message": "slow down"}})
        elif text.startswith("malformed"):
            await _json(send, 200, {"id": "x", "choices": [None]})
        elif text.startswith("bad"):
            await _json(send, 400, {"error": {"message": "max_tokens is too large: 10^9"}})
        elif text.startswith("cut"):
            if request.get("stream"):
                await _stream_start(send)
                await _event(send, _chunk(chat, "half"))
                raise ConnectionResetError("dropped mid-stream on purpose")
            data = json.dumps(_answer(chat, request, " never whole")).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(data)).encode()),
                    ],
                }
            )
            await send(
                {"type": "http.response.body", "body": data[: len(data) // 2], "more_body": True}
            )
            raise ConnectionResetError("dropped mid-body on purpose")
        elif text.startswith("slow"):
            if request.get("stream"):
                await _stream_start(send)
            await asyncio.sleep(SLOW_S)
            await _json(send, 200, _answer(chat, request, " late"))
        elif text.startswith("dropfirst") and count == 1:
            raise ConnectionResetError("dropped before answering on purpose")
        elif request.get("stream"):
            await _stream_start(send)
            for word in (" echo:", f" {text}"):
                await _event(send, _chunk(chat, word))
            await _event(send, _chunk(chat, "", finish="stop"))
            await _event(send, {"choices": [], "usage": _usage()})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            await _json(send, 200, _answer(chat, request, f" echo: {text}"))


def _usage() -> dict:
    return {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def _answer(chat: bool, request: dict, text: str) -> dict:
    choice = {"index": 0, "finish_reason": "stop", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": "x",
        "object": "chat.completion" if chat else "text_completion",
        "model": request.get("model"),
        "choices": [choice],
        "usage": _usage(),
    }


def _chunk(chat: bool, text: str, finish: str | None = None) -> dict:
    choice = {"index": 0, "finish_reason": finish}
    if chat:
        choice["delta"] = {"content": text} if text else {}
    else:
        choice["text"] = text
    return {"id": "x", "choices": [choice]}


async def _json(send, status: int, data: dict, headers: list | None = None) -> None:
    body = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _stream_start(send) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )


async def _event(send, data: dict) -> None:
    await send(
        {
            "type": "http.response.body",
            "body": f"data: {json.dumps(data)}\n\n".encode(),
            "more_body": True,
        }
    )


class FaultServer:
    """FaultApp on a free loopback port, in a daemon thread."""

    def __init__(self) -> None:
        self.app = FaultApp()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        config = uvicorn.Config(self.app, log_level="critical", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the fault server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.force_exit = True  # not waiting for a handler still in its SLOW_S sleep
        self.thread.join(10)
