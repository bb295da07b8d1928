"""SamplingParams: per-request generation knobs, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's top_logprobs limit)
# Bounds that keep hostile values from breaking a whole batch: logits divided by a smaller
# temperature or repetition penalty overflow float32 (NaN probabilities); a seed must fit a
# generator's 64 bits (plus one per sample); n is capped as in the OpenAI API.
MIN_TEMPERATURE = 1e-5
MIN_REPETITION_PENALTY = 1e-5
MAX_SEED = 2**63 - 1
MAX_N = 128


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
    # None: no log-probabilities; K >= 0: each generated token's log-probability and the K
    # most likely tokens at its position (log-softmax of the model's own logits).
    logprobs: int | None = None

    def __post_init__(self) -> None:
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
        return {f.name for f in fields(cls)}


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
