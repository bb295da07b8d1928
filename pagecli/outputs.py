"""What the engine hands back: RequestOutput (one per request) and CompletionOutput (one per
sample)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The log-probability of one generated token and the most likely tokens at its place."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class CompletionOutput:
    """One sample of a request. `delta` is the text added since the previous report."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    delta: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ServerReport:
    """What a remote server said of a finished request, where pagecli cannot count itself."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the server did not say
    has_token_ids: bool  # whether the outputs' token_ids (and prompt_token_ids) came back
    logprobs: list  # per sample: the server's own logprobs object, or None


@dataclass
class RequestOutput:
    """The state of one request. `text`, `token_ids` and `finish_reason` are those of the
    first sample; `outputs` lists every sample (n > 1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    server: ServerReport | None = None  # set for a request answered by a remote endpoint

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else ("error" if self.error else None)

    @property
    def delta(self) -> str:
        return self.outputs[0].delta if self.outputs else ""
