"""PromptEncoder: every accepted prompt form (text, chat messages, token ids) to token ids,
within the limits of one engine. Shared by the Python API and the local backend."""

from __future__ import annotations

from typing import Any, Union

from pagecli.engine.llm_engine import LLMEngine, RequestError
from pagecli.tokenizer import PromptTooLongError

# A prompt: raw text, a list of chat messages, or {"prompt_token_ids": [...]}.
Prompt = Union[str, list[dict[str, Any]], dict[str, Any]]


class PromptEncoder:
    """Token ids of prompts for `engine`; text that cannot fit is refused after tokenizing a
    bounded prefix of it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def prompt_limit(self) -> tuple[int, str]:
        """The most tokens a prompt can have and what sets it ("max_model_len" or "the KV
        cache")."""
        engine = self.engine
        limit = min(engine.max_model_len, engine.capacity_tokens)
        return limit, "max_model_len" if limit == engine.max_model_len else "the KV cache"

    def encode_prompt(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids (and text, when known) of a prompt in any accepted form. Text that cannot
        fit raises RequestError after tokenizing at most a bounded prefix of it."""
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("a dict prompt needs 'prompt_token_ids': a list of integers")
            return list(ids), None
        if self.tokenizer is None:
            raise ValueError(
                f"{self.engine.source.name} has no tokenizer: give prompt_token_ids instead"
            )
        if isinstance(prompt, str):
            return self.encode_text(prompt), prompt
        if isinstance(prompt, list):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            # The template already holds any BOS: no special tokens are added again.
            return self.encode_text(text, add_special_tokens=False), text
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text, or RequestError when it has more tokens than any prompt can
        (decided from a prefix: a 50 MB line costs as much as one that just fits)."""
        limit, what = self.prompt_limit()
        try:
            return self.tokenizer.encode(text, limit, add_special_tokens)
        except PromptTooLongError as exc:
            raise RequestError(f"{exc}: it does not fit {what} ({limit} tokens)") from None
