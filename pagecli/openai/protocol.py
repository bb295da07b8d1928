"""The OpenAI API's request bodies as pydantic models, and the one mapping between them and
SamplingParams, both ways. Three users, one protocol:
- `pagecli serve` validates its requests with the models (server/generation.py);
- `pagecli generate` validates OpenAI batch lines with the same models (batch/openai_batch.py), as
  vLLM's `run-batch` does;
- the remote backend writes its requests with `sampling_body`, the inverse of
  `sampling_params` (backends/remote.py).

Unknown fields are kept (`extra="allow"`) so that real clients, which send fields of newer API
versions, keep working: the server logs one warning line naming them; a batch line, which
nobody reads live, is refused instead. Fields that would change the output and that the
engine cannot honour are refused, naming the field. No FastAPI here, and no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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

    def _sampling_params(self, base: Mapping[str, Any], logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request over `base` (the endpoint's defaults, or a CLI's):
        only the fields the request set replace it. ValueError names the bad field."""
        values = dict(base)
        given = self.model_fields_set
        if self.max_completion_tokens is not None:
            values["max_tokens"] = self.max_completion_tokens
        elif self.max_tokens is not None:
            values["max_tokens"] = self.max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        fields = {
            "n": self.n,
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        values.update({k: v for k, v in fields.items() if k in given and v is not None})
        if logprobs is not None:
            values["logprobs"] = logprobs
        extra = self.model_extra or {}
        if any(k in extra for k in ("response_format", "structured_outputs", *GUIDED_FIELDS)):
            values["structured"] = self.structured()  # replaces a default, even with none
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

    def sampling_params(self, base: Mapping[str, Any] | None = None) -> SamplingParams:
        """Over `base`, or the endpoint's defaults: without max_tokens a chat reply may run to
        the end of the context, as in vLLM."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params({"max_tokens": None} if base is None else base, logprobs)


# A completion prompt: text, token ids, or a batch of either.
CompletionPrompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    UNSUPPORTED: ClassVar[tuple[str, ...]] = (*UNSUPPORTED_FIELDS, "tools", "tool_choice")

    prompt: CompletionPrompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def sampling_params(self, base: Mapping[str, Any] | None = None) -> SamplingParams:
        """Over `base`, or the endpoint's defaults: the legacy endpoint's default is 16
        tokens, as in OpenAI's API and vLLM."""
        return self._sampling_params({"max_tokens": 16} if base is None else base, self.logprobs)

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


# ---- the other way: SamplingParams as request fields ------------------------------------------


def sampling_body(params: SamplingParams, chat: bool) -> dict[str, Any]:
    """The request fields of `params`, the inverse of `sampling_params`: what a request built
    from them reads back as the same SamplingParams. pagecli's defaults are sent only where
    servers disagree on them, extensions (top_k, min_p, ...) only when they are set."""
    body: dict[str, Any] = {"temperature": params.temperature}
    if params.max_tokens is not None:
        body["max_tokens"] = params.max_tokens
    if params.n != 1:
        body["n"] = params.n
    if params.top_p != 1.0:
        body["top_p"] = params.top_p
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.min_p > 0:
        body["min_p"] = params.min_p
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if not params.skip_special_tokens:
        body["skip_special_tokens"] = False
    if params.logprobs is not None:
        if chat:
            body.update(logprobs=True, top_logprobs=params.logprobs)
        else:
            body["logprobs"] = params.logprobs
    if params.structured is not None:
        body.update(structured_body(params.structured))
    return body


def structured_body(spec: StructuredOutputs) -> dict[str, Any]:
    """The request fields of an output constraint: OpenAI's standard `response_format` for
    JSON (what most servers accept), vLLM's `structured_outputs` for what it cannot say (a
    regex, a choice, a grammar, or JSON without whitespace; vLLM and `pagecli serve` take it)."""
    if spec.whitespace == "bounded":
        if spec.json_object:
            return {"response_format": {"type": "json_object"}}
        if spec.json_schema is not None:
            schema = {"name": "schema", "schema": spec.json_schema}
            return {"response_format": {"type": "json_schema", "json_schema": schema}}
    fields: dict[str, Any] = {
        "json": spec.json_schema,
        "json_object": spec.json_object or None,
        "regex": spec.regex,
        "choice": spec.choice,
        "grammar": spec.grammar,
    }
    out = {k: v for k, v in fields.items() if v is not None}
    if spec.whitespace == "compact":
        out["disable_any_whitespace"] = True
    return {"structured_outputs": out}


# ---- validation errors ------------------------------------------------------------------------


# The parts of a pydantic error location that name a union member's type, not a field:
# `messages[0].content.str` says which of content's types failed last.
_TYPE_TAG = re.compile(
    r"[A-Z]\w*|(str|int|float|bool|none|list|dict|tuple|literal|function-\w+|json-or-python"
    r"|tagged-union|union)(\[.*\])?"
)


def field_path(loc: tuple, prefix: str = "") -> str | None:
    """A pydantic error location as the field's path (`messages[0].content`), after
    `prefix` (`body.` for a batch line); None for the body itself."""
    parts = [str(p) for p in loc if p != "body" and not _TYPE_TAG.fullmatch(str(p))]
    if not parts:
        return None
    path = prefix + parts[0]
    for part in parts[1:]:
        path += f"[{part}]" if part.isdigit() else f".{part}"
    return path


def first_error(errors: list[dict[str, Any]], prefix: str = "") -> tuple[str, str | None]:
    """The first problem pydantic found, as (one-line message, the field's path or None)."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    message = str(first.get("msg", "invalid value")).splitlines()[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({message})", None
    field = field_path(tuple(first.get("loc", ())), prefix)
    if field is None:
        return f"invalid request body: {message}", None
    return f"{field}: {message}", field


# ---- batch lines ------------------------------------------------------------------------------

# The batch API's endpoints and the body each takes.
BATCH_URLS: dict[str, type[_SamplingRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


class BatchLine(BaseModel):
    """One line of an OpenAI batch input file."""

    model_config = ConfigDict(extra="forbid")
    custom_id: str
    method: Literal["POST"] = "POST"
    url: str
    body: dict[str, Any]


def batch_request(url: str, body: dict[str, Any]) -> _SamplingRequest:
    """A batch line's body as the request it stands for. ValueError (naming `body.FIELD`) for
    a body the endpoint would refuse, an unknown field (nobody reads a batch's warnings live),
    or what a batch answer cannot carry: a stream, logprobs, tool calls."""
    from pydantic import ValidationError

    model = BATCH_URLS[url]
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise ValueError(first_error(exc.errors(), "body.")[0]) from None
    extra = request.model_extra or {}
    unsupported = request.unsupported_field()
    if unsupported is None:
        for name in request.UNSUPPORTED:
            if name in extra:  # asks for nothing (an empty list), and is not a field here
                unsupported = name
                break
    if unsupported is not None:
        raise ValueError(f"body.{unsupported} is not supported")
    unknown = request.unknown_fields()
    if unknown:
        raise ValueError(f"unknown field body.{unknown[0]}")
    for name in ("stream", "logprobs", "tools", "tool_choice"):
        value = getattr(request, name, None)
        if value not in (None, False, "none"):
            raise ValueError(f"body.{name} is not supported in batch lines")
    return request
