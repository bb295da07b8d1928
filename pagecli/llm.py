"""LLM: the Python face of the engine (generate, stream)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from pagecli.config import EngineConfig
from pagecli.outputs import RequestOutput
from pagecli.sampling_params import SamplingParams
from pagecli.tokenizer import PromptTooLongError

if TYPE_CHECKING:  # the engine (and torch) load with the first LLM, not with this module
    from pagecli.engine.prompts import Prompt


class LLM:
    """Load a model once and generate with it.

    >>> llm = LLM()  # the default model, SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    """

    def __init__(self, model: str | None = None, **engine_config: Any) -> None:
        unknown = set(engine_config) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        from pagecli.engine.llm_engine import LLMEngine
        from pagecli.engine.prompts import PromptEncoder

        self.config = EngineConfig(model=model, **engine_config)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._encoder = PromptEncoder(self.engine)
        self._ids = itertools.count()

    # ---- prompts -------------------------------------------------------------------------

    def prompt_limit(self) -> tuple[int, str]:
        """The most tokens a prompt can have and what sets it ("max_model_len" or "the KV
        cache")."""
        return self._encoder.prompt_limit()

    def encode_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids (and text, when known) of a prompt in any accepted form. Text that cannot
        fit raises RequestError after tokenizing at most a bounded prefix of it."""
        return self._encoder.encode_prompt(prompt)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, or RequestError when it has more tokens than any prompt can."""
        return self._encoder.encode_text(text, add_special_tokens)

    # ---- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts together (continuously batched); one output per prompt, in order.

        A prompt that can never run (too long) gets an output with finish_reason "error" and
        the reason in `error`; the others are unaffected.
        """
        from pagecli.engine.llm_engine import RequestError

        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list)
            and prompts
            and isinstance(prompts[0], dict)
            and "role" in prompts[0]
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, params in zip(prompts, params_list):
            request_id = f"req-{next(self._ids)}"
            order.append(request_id)
            ids, text = [], prompt if isinstance(prompt, str) else None
            try:
                ids, text = self.encode_prompt(prompt)
                self.engine.add_request(request_id, ids, params, prompt=text)
            except RequestError as exc:
                results[request_id] = RequestOutput(
                    request_id, text, ids, finished=True, error=str(exc)
                )
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [results[r] for r in order]

    def chat_session(self, system: str | None = None, name: str = "default") -> ChatSession:
        """A multi-turn conversation whose turns reuse the KV cache of the previous ones."""
        return ChatSession(self, system=system, name=name)

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes now (they also stop when the
        LLM is collected or the process exits); a no-op with one rank."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output after every step that adds text (`output.delta`)."""
        request_id = f"req-{next(self._ids)}"
        ids, text = self.encode_prompt(prompt)
        self.engine.add_request(request_id, ids, sampling_params or SamplingParams(), text)
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort_request(request_id)


class ChatSession:
    """A conversation that keeps the exact token ids it has seen and produced.

    Each turn's prompt is the previous turn's prompt, the generated ids, and the ids of the
    newly rendered part of the chat template, so it extends the cached prefix instead of
    re-tokenizing decoded text. Sessions with the same system prompt share its KV blocks
    through the prefix cache.
    """

    #: Whether turns are tokenized here (token-exact); a session held as messages only, for
    #: a server that tokenizes them itself, says False.
    needs_tokenizer = True

    def __init__(self, llm: LLM, system: str | None = None, name: str = "default") -> None:
        if self.needs_tokenizer and llm.tokenizer is None:
            raise ValueError(f"{llm.engine.source.name} has no tokenizer: chat needs one")
        self.llm = llm
        self.name = name
        self.system = system
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.token_ids: list[int] = []  # the conversation so far, exactly as the model saw it
        self.warnings: list[str] = []

    def prompt_ids(self, user_text: str) -> list[int]:
        """The token ids of the next turn's prompt (the conversation plus `user_text`)."""
        from pagecli.engine.llm_engine import RequestError

        tok = self.llm.tokenizer
        messages = self.messages + [{"role": "user", "content": user_text}]
        full_text = tok.apply_chat_template(messages, add_generation_prompt=True)
        if not self.token_ids:
            return self.llm.encode_text(full_text, add_special_tokens=False)
        kept_text = tok.decode(self.token_ids, skip_special_tokens=False)
        if full_text.startswith(kept_text):
            new_text = full_text[len(kept_text) :]
            limit, what = self.llm.prompt_limit()
            room = limit - len(self.token_ids)
            try:
                return self.token_ids + tok.encode(new_text, room, add_special_tokens=False)
            except PromptTooLongError:
                raise RequestError(
                    f"message of {len(user_text)} characters has more than the {room} tokens "
                    f"left in {what} ({limit} tokens)"
                ) from None
        turn = sum(1 for m in self.messages if m["role"] == "assistant")
        warning = (
            f"session {self.name!r}: the chat template renders turn {turn} differently from "
            "the tokens kept for it; the prompt is re-rendered and the KV cache is reused only "
            "up to where they agree"
        )
        self.warnings.append(warning)
        warnings.warn(warning, stacklevel=3)
        return self.llm.encode_text(full_text, add_special_tokens=False)

    def record(self, user_text: str, prompt_ids: list[int], output: RequestOutput) -> None:
        """Remember a finished turn: its prompt ids, the generated ids and the reply text."""
        self.messages.append({"role": "user", "content": user_text})
        self.messages.append({"role": "assistant", "content": output.text})
        self.token_ids = list(prompt_ids) + list(output.token_ids)

    def send(self, user_text: str, sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One turn: the whole reply at once."""
        final = None
        for output in self.stream(user_text, sampling_params):
            final = output
        return final

    def stream(
        self, user_text: str, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """One turn, yielding outputs as text arrives. A turn that is interrupted keeps what
        was generated so far."""
        ids = self.prompt_ids(user_text)
        last = None
        try:
            for last in self.llm.stream({"prompt_token_ids": ids}, sampling_params):
                yield last
        finally:
            if last is not None:
                self.record(user_text, ids, last)
