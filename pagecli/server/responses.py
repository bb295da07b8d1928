"""The OpenAI response shapes: whole bodies and streaming chunks, for chat completions and
(legacy) completions, with logprobs in each endpoint's own format."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pagecli.outputs import CompletionOutput, TokenLogprob
from pagecli.server.tool_calls import CallFormat, ParsedMessage, StreamParser, parse


@dataclass
class ReplyParsing:
    """How a chat reply's text is read: tool calls in `fmt` (None: none are parsed) among
    `tools`, and reasoning before `</think>` when `reasoning` is set."""

    fmt: str | CallFormat | None
    tools: list[dict]
    reasoning: bool

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def parse(self, text: str) -> ParsedMessage:
        return parse(text, *self._scanner(), tools=self.tools)

    def _scanner(self) -> tuple[str | CallFormat, set[str], bool]:
        # Reasoning alone: no tool name is known, so no text is ever taken for a call.
        return (self.fmt or "hermes", self.names if self.fmt else set(), self.reasoning)

    def stream_parser(self) -> StreamParser:
        return StreamParser(*self._scanner(), tools=self.tools)


@dataclass
class ChoiceState:
    """What a streamed choice has sent so far."""

    num_tokens: int = 0  # token ids whose logprobs went out
    num_ids: int = 0  # token ids seen
    pending_ids: list[int] = field(default_factory=list)  # seen, not yet sent
    num_chars: int = 0  # characters of text (for completions' text_offset)
    done: bool = False
    parser: StreamParser | None = None  # a chat reply read for tool calls or reasoning
    num_calls: int = 0


@dataclass
class ResponseFormat:
    """Builds the bodies of one response (`kind` chooses chat or completion shapes)."""

    kind: Literal["chat", "completion"]
    response_id: str
    model: str
    tokenizer: Any  # pagecli.tokenizer.Tokenizer, for the text of logprob tokens
    created: int = field(default_factory=lambda: int(time.time()))
    reply: ReplyParsing | None = None  # chat: tool calls and reasoning read from the text

    @property
    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _head(self, streaming: bool) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" and streaming else self._object
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    # ---- whole responses -----------------------------------------------------------------

    def full_choice(
        self, index: int, c: CompletionOutput, prompt_token_ids: list[int] | None = None
    ) -> dict[str, Any]:
        """A whole choice; with `prompt_token_ids` (return_token_ids) the ids ride along."""
        logprobs = self._logprobs(c.logprobs or [], 0) if c.logprobs is not None else None
        choice: dict[str, Any] = {"index": index}
        finish_reason = c.finish_reason
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            if self.reply is not None:
                parsed = self.reply.parse(c.text)
                message["content"] = parsed.content
                if parsed.reasoning_content is not None:
                    message["reasoning_content"] = parsed.reasoning_content
                if parsed.tool_calls:
                    message["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
            choice["message"] = message
        else:
            choice["text"] = c.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = c.stop_reason
        if finish_reason == "error":
            choice["error"] = self.choice_error(c)
        if prompt_token_ids is not None:
            choice["token_ids"] = c.token_ids
            choice["prompt_token_ids"] = prompt_token_ids
        return choice

    def full_response(self, choices: list[dict], usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(False), "choices": choices, "usage": usage}

    # ---- streaming -----------------------------------------------------------------------

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant role; completions do not."""
        if self.kind != "chat":
            return None
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta_choice(
        self, index: int, c: CompletionOutput, state: ChoiceState, with_ids: bool = False
    ) -> dict[str, Any] | None:
        """The part of a choice not yet sent, or None when there is nothing new."""
        if state.done:
            return None
        new_ids = c.token_ids[state.num_ids :]
        state.num_ids = len(c.token_ids)
        new_logprobs = None
        if c.logprobs is not None:
            new = c.logprobs[state.num_tokens :]
            if new:
                new_logprobs = self._logprobs(new, state.num_chars)
            state.num_tokens = len(c.logprobs)
        if not c.delta and new_logprobs is None and c.finish_reason is None:
            if with_ids and new_ids:  # the ids of text held back (a partial character)
                state.pending_ids += new_ids
            return None
        finish_reason = c.finish_reason
        if self.kind == "chat" and self.reply is not None:
            delta = self._parsed_delta(c, state)
            if not delta and new_logprobs is None and finish_reason is None:
                if with_ids and new_ids:
                    state.pending_ids += new_ids
                state.num_chars += len(c.delta)
                return None  # held back: it may be the start of a call
            if state.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        elif self.kind == "chat":
            delta = {"content": c.delta} if c.delta else {}
        state.num_chars += len(c.delta)
        state.done = c.finish_reason is not None
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            choice["delta"] = delta
        else:
            choice["text"] = c.delta
        choice["logprobs"] = new_logprobs
        choice["finish_reason"] = finish_reason
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if c.finish_reason == "error":
            choice["error"] = self.choice_error(c)
        if with_ids:
            choice["token_ids"], state.pending_ids = state.pending_ids + new_ids, []
        return choice

    def _parsed_delta(self, c: CompletionOutput, state: ChoiceState) -> dict[str, Any]:
        """The chat delta of the new text, read for calls and reasoning: text that may start
        a call is held back until it is decided."""
        if state.parser is None:
            state.parser = self.reply.stream_parser()
        events = state.parser.feed(c.delta) if c.delta else []
        if c.finish_reason is not None:
            events += state.parser.finish()
        delta: dict[str, Any] = {}
        for event in events:
            for key in ("reasoning_content", "content"):
                if event.get(key):
                    delta[key] = delta.get(key, "") + event[key]
            calls = event.get("tool_calls")
            if calls:
                delta.setdefault("tool_calls", []).extend(calls)
                state.num_calls += len(calls)
        return delta

    def chunk(self, choices: list[dict], include_usage: bool) -> dict[str, Any]:
        body = {**self._head(True), "choices": choices}
        if include_usage:
            body["usage"] = None  # the usage chunk at the end carries it
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

    def choice_error(self, c: CompletionOutput) -> dict[str, Any]:
        """Why a choice ended in "error": never a silent short reply."""
        if c.stop_reason == "grammar":
            last = c.token_ids[-1] if c.token_ids else None
            text = "" if last is None else f" (token {last}, {self._token_text(last)!r})"
            message = (
                f"generation stopped after {len(c.token_ids)} tokens: the output grammar "
                f"(response_format, structured_outputs or the tool-call grammar) could not "
                f"continue{text}"
            )
        else:
            message = f"generation stopped by an error ({c.stop_reason})"
        return {"message": message, "type": "server_error", "code": "generation_error"}

    def error_event(self, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}

    # ---- logprobs ------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
        if self.kind == "chat":
            content = []
            for e in entries:
                token = self._token_text(e.token_id)
                content.append(
                    {
                        "token": token,
                        "logprob": e.logprob,
                        "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [
                            {
                                "token": (t := self._token_text(i)),
                                "logprob": lp,
                                "bytes": list(t.encode("utf-8")),
                            }
                            for i, lp in e.top
                        ],
                    }
                )
            return {"content": content}
        tokens, token_logprobs, top, offsets = [], [], [], []
        for e in entries:
            token = self._token_text(e.token_id)
            tokens.append(token)
            token_logprobs.append(e.logprob)
            top.append({self._token_text(i): lp for i, lp in e.top})
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }
