"""SamplingParams: per-request generation knobs, validated once."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's top_logprobs limit)
# Bounds that keep hostile values from breaking a whole batch: logits divided by a smaller
# temperature or repetition penalty overflow float32 (NaN probabilities); a seed must fit a
# generator's 64 bits (plus one per sample); n is capped as in the OpenAI API.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-5
MAX_SEED = 2**63 - 1
MAX_N = 128

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what a request may generate; exactly one kind is set.

    - `json_schema`: a JSON Schema (a dict, or its JSON text); the output is one JSON value
      that the schema validates. Keywords the compiler does not implement are refused by name.
    - `json_object`: any JSON object.
    - `regex`: the whole output matches this regular expression (Rust `regex` syntax).
    - `choice`: the output is exactly one of these strings.
    - `grammar`: a context-free grammar in llguidance's Lark syntax, or llama.cpp's GBNF.
    `whitespace` ("bounded" or "compact") chooses how much whitespace JSON may have between its
    tokens: at most a short run, or none at all (see engine/structured.py).
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    whitespace: str = "bounded"

    def __post_init__(self) -> None:
        chosen = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                f"structured outputs need exactly one of {', '.join(STRUCTURED_KINDS)} (got {got})"
            )
        if isinstance(self.json_schema, str):
            try:
                value = json.loads(self.json_schema)
            except ValueError as exc:
                raise ValueError(f"json_schema is not valid JSON: {exc}") from None
            object.__setattr__(self, "json_schema", value)
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a JSON object, got {self.json_schema!r:.60}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be true or false, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r:.60}")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and self.choice
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    f"choice must be a non-empty list of non-empty strings, got {self.choice!r:.60}"
                )
            object.__setattr__(self, "choice", list(self.choice))
        if self.whitespace not in ("bounded", "compact"):
            raise ValueError(f"whitespace must be 'bounded' or 'compact', got {self.whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def coerce(cls, value: object) -> StructuredOutputs:
        """From a StructuredOutputs or a dict of its fields (what JSONL records and asdict()
        give); ValueError names an unknown field."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured must be an object, got {value!r:.60}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"structured: unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})"
            )
        return cls(**value)

    @classmethod
    def from_openai(
        cls, response_format: object = None, structured_outputs: object = None
    ) -> StructuredOutputs | None:
        """The constraint of an OpenAI request: `response_format` ({"type": "text" |
        "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}) or
        vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar" |
        "json_object", "disable_any_whitespace"}). None when neither constrains anything;
        ValueError (starting with the field's name) for a bad or unsupported value.

        With `strict: true`, objects that do not say otherwise get `additionalProperties:
        false`, as OpenAI's strict mode requires of them: no keys the schema does not name.
        """
        given = [
            (n, v)
            for n, v in (
                ("response_format", response_format),
                ("structured_outputs", structured_outputs),
            )
            if v not in (None, {})
        ]
        if len(given) > 1:
            raise ValueError("response_format and structured_outputs: set one of them, not both")
        if not given:
            return None
        name, value = given[0]
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object, got {value!r:.60}")
        if name == "response_format":
            kind = value.get("type")
            if kind == "text":
                return None
            if kind == "json_object":
                return cls(json_object=True)
            if kind != "json_schema":
                raise ValueError(
                    f"response_format.type must be text, json_object or json_schema, got {kind!r}"
                )
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format.json_schema needs a `schema` object")
            schema = spec["schema"]
            if spec.get("strict"):
                schema = _closed_objects(schema)
            return cls(json_schema=schema)
        renames = {
            "json": "json_schema",
            "regex": "regex",
            "choice": "choice",
            "grammar": "grammar",
            "json_object": "json_object",
        }
        unknown = sorted(set(value) - set(renames) - {"disable_any_whitespace"})
        if unknown:
            raise ValueError(f"structured_outputs: unsupported field(s) {', '.join(unknown)}")
        fields_ = {renames[k]: v for k, v in value.items() if k in renames and v is not None}
        if value.get("disable_any_whitespace"):
            fields_["whitespace"] = "compact"
        try:
            return cls(**fields_)
        except ValueError as exc:
            raise ValueError(f"structured_outputs: {exc}") from None

    def key(self) -> str:
        """A canonical text of the constraint: equal keys compile to the same grammar."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


@dataclass
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy decoding.

    `max_tokens=None` generates until a stop condition or the model's context length.
    `stop` strings end generation; the matched string is not part of the output text.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    # Special tokens whose text stays in the output though skip_special_tokens is set (a
    # tool-call format's tags, such as Mistral's [TOOL_CALLS]); set by the server.
    keep_token_ids: tuple[int, ...] = field(default=(), metadata={"internal": True})
    # None: no log-probabilities; K >= 0: each generated token's log-probability and the K
    # most likely tokens at its position (log-softmax of the model's own logits).
    logprobs: int | None = None
    # A grammar the output must follow (JSON schema, regex, choice, grammar); None: free text.
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.structured is not None:
            self.structured = StructuredOutputs.coerce(self.structured)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _int("n", self.n, low=1, high=MAX_N)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, low=0.0)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature!r}"
            )
        _number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _int("top_k", self.top_k, low=-1)
        _number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _int("seed", self.seed, low=0, high=MAX_SEED)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            got = self.stop_token_ids
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {got!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        _number("repetition_penalty", self.repetition_penalty, low=MIN_REPETITION_PENALTY)
        if self.repetition_penalty == 0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        _number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, low=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(
                    f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}"
                )

    @property
    def greedy(self) -> bool:
        """True when the next token is always the argmax."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @classmethod
    def field_names(cls) -> set[str]:
        """The fields a user sets (internal ones, set by the server, left out)."""
        return {f.name for f in fields(cls) if not f.metadata.get("internal")}


def _closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that names its
    properties and says nothing of others (OpenAI's strict mode)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _int(name: str, value: object, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def _number(name: str, value: object, low: float, high: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok or value != value:  # NaN fails every comparison
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")
