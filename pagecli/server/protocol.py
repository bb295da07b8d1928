"""The OpenAI request bodies `pagecli serve` accepts, as pydantic models, and their mapping to
SamplingParams.

Unknown fields are kept (`extra="allow"`) so that real clients, which send fields of newer API
versions, keep working: the server logs one warning line naming them. Fields that would change
the output and that the engine cannot honour are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagecli.sampling_params import MAX_LOGPROBS, SamplingParams

# Fields that change what is generated, which the engine does not implement. A request that
# sets one (to anything but null, false or an empty list) gets a 400 naming it.
UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logit_bias",
    "response_format",
    "audio",
    "prediction",
    "web_search_options",
    "suffix",
    "echo",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "prompt_logprobs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "logits_processors",
)
# Fields that are accepted and have no effect on a local engine (no warning for them).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# response_format {"type": "text"} and modalities ["text"] ask for what the engine does anyway.
_HARMLESS = {"response_format": ({"type": "text"},), "modalities": (["text"],)}


class TextPart(BaseModel):
    """A content part of a chat message; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content parts are joined into one string."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extension: each choice also carries its token ids and the prompt's.
    return_token_ids: bool = False

    def unsupported_field(self) -> str | None:
        """The first field set that would change the output and that the engine lacks."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED_FIELDS:
            value = extra.get(name)
            if value is None or value is False or value == [] or value == {}:
                continue
            if value in _HARMLESS.get(name, ()):
                continue
            return name
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        modalities = extra.get("modalities")
        if modalities not in (None, ["text"]):
            return "modalities"
        return None

    def unknown_fields(self) -> list[str]:
        """Fields nobody here knows: ignored, with a warning in the log."""
        known = {*UNSUPPORTED_FIELDS, *IGNORED_FIELDS, *_HARMLESS}
        return sorted(k for k in (self.model_extra or {}) if k not in known)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _max_tokens(self, default: int | None) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens if self.max_tokens is not None else default

    def _sampling_params(self, max_tokens_default: int | None, logprobs: int | None):
        """SamplingParams of this request; ValueError names the bad field."""
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self._max_tokens(max_tokens_default),
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "logprobs": logprobs,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        values.update({k: v for k, v in optional.items() if v is not None})
        return SamplingParams(**values)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def sampling_params(self) -> SamplingParams:
        """Without max_tokens a chat reply may run to the end of the context, as in vLLM."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(None, logprobs)


# A completion prompt: text, token ids, or a batch of either.
CompletionPrompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: CompletionPrompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def sampling_params(self) -> SamplingParams:
        """The legacy endpoint's default is 16 tokens, as in OpenAI's API and vLLM."""
        return self._sampling_params(16, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


class TokenizeRequest(BaseModel):
    """POST /tokenize: a text prompt or chat messages."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]
