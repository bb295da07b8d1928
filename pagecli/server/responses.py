"""The OpenAI response shapes: whole bodies and streaming chunks, for chat completions and
(legacy) completions, with logprobs in each endpoint's own format."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pagecli.outputs import CompletionOutput, TokenLogprob


@dataclass
class ChoiceState:
    """What a streamed choice has sent so far."""

    num_tokens: int = 0  # token ids whose logprobs went out
    num_ids: int = 0  # token ids seen
    pending_ids: list[int] = field(default_factory=list)  # seen, not yet sent
    num_chars: int = 0  # characters of text (for completions' text_offset)
    done: bool = False


@dataclass
class ResponseFormat:
    """Builds the bodies of one response (`kind` chooses chat or completion shapes)."""

    kind: Literal["chat", "completion"]
    response_id: str
    model: str
    tokenizer: Any  # pagecli.tokenizer.Tokenizer, for the text of logprob tokens
    created: int = field(default_factory=lambda: int(time.time()))

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
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason
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
        state.num_chars += len(c.delta)
        state.done = c.finish_reason is not None
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            choice["delta"] = {"content": c.delta} if c.delta else {}
        else:
            choice["text"] = c.delta
        choice["logprobs"] = new_logprobs
        choice["finish_reason"] = c.finish_reason
        if c.finish_reason is not None:
            choice["stop_reason"] = c.stop_reason
        if with_ids:
            choice["token_ids"], state.pending_ids = state.pending_ids + new_ids, []
        return choice

    def chunk(self, choices: list[dict], include_usage: bool) -> dict[str, Any]:
        body = {**self._head(True), "choices": choices}
        if include_usage:
            body["usage"] = None  # the usage chunk at the end carries it
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}

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
