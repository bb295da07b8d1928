"""The OpenAI request bodies `pagecli serve` accepts, as pydantic models, and their mapping to
SamplingParams.

Unknown fields are kept (`extra="allow"`) so that real clients, which send fields of newer API
versions, keep working: the server logs one warning line naming them. Fields that would change
the output and that the engine cannot honour are refused with a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagecli.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

# Fields that change what is generated, which the engine does not implement. A request that
# sets one (to anything but null, false or an empty list) gets a 400 naming it.
UNSUPPORTED_FIELDS = (
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "prediction",
    "web_search_options",
    "suffix",
    "echo",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "prompt_logprobs",
    "guided_decoding_backend",
    "structural_tag",
    "logits_processors",
)
# vLLM's older spellings of structured_outputs' fields (still sent by many clients).
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# Fields that are accepted and have no effect on a local engine (no warning for them).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "parallel_tool_calls")
# response_format {"type": "text"} and modalities ["text"] ask for what the engine does anyway.
_HARMLESS = {"response_format": ({"type": "text"},), "modalities": (["text"],)}


class TextPart(BaseModel):
    """A content part of a chat message; only text parts are supported."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = "{}"


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant message, sent back in the conversation."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One chat message; content parts are joined into one string."""

    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # chat templates read the arguments as a mapping (transformers' convention)
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _arguments(text: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text  # the template shows what the client sent


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    """A tool the model may call (OpenAI's function tools)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition

    def as_template_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.function.name}
        if self.function.description:
            fn["description"] = self.function.description
        fn["parameters"] = self.function.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: dict[str, Any]


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
        for name in self.UNSUPPORTED:
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

    UNSUPPORTED: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    def unknown_fields(self) -> list[str]:
        """Fields nobody here knows: ignored, with a warning in the log."""
        known = {
            *UNSUPPORTED_FIELDS,
            *IGNORED_FIELDS,
            *_HARMLESS,
            *GUIDED_FIELDS,
            "response_format",
            "structured_outputs",
            "tools",
            "tool_choice",
        }
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
        values["structured"] = self.structured()
        return SamplingParams(**values)

    def structured(self) -> StructuredOutputs | None:
        """The output constraint of `response_format`, `structured_outputs` or vLLM's older
        `guided_*` fields; ValueError names the field."""
        extra = self.model_extra or {}
        outputs = extra.get("structured_outputs")
        guided = {GUIDED_FIELDS[k]: v for k, v in extra.items() if k in GUIDED_FIELDS and v}
        if guided:
            if outputs:
                raise ValueError("structured_outputs and guided_*: set one of them, not both")
            outputs = guided
        return StructuredOutputs.from_openai(extra.get("response_format"), outputs)


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None

    def tool_choice_name(self) -> str | None:
        """The tool a named tool_choice forces; ValueError when it names none of the tools."""
        if not isinstance(self.tool_choice, NamedToolChoice):
            return None
        name = self.tool_choice.function.get("name")
        names = [t.function.name for t in self.tools or []]
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        return name

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

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (*UNSUPPORTED_FIELDS, "tools", "tool_choice")

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
