"""Structured outputs: one grammar matcher per constrained sequence (llguidance), the token
bitmask filled on its own thread while the forward pass runs, applied to the logits before
sampling, and the matcher advanced with each sampled token.

Compilation happens off the engine thread, in a small pool, under a time limit: a request whose
grammar fails, or does not compile in time, is refused (RequestError) and never runs
unconstrained. llguidance compiles lazily and bounds its work per step (LLParserLimits), so a
compile that overruns the limit still ends on its own; its thread is left to finish and its
result dropped.

Unconstrained rows pay nothing: a step with no constrained row never touches this module.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagecli.errors import StructuredOutputError, one_line
from pagecli.sampling_params import StructuredOutputs

# JSON may put whitespace between any two of its tokens. A model that starts emitting it can
# loop there until max_tokens (the most common structured-output complaint); "bounded" allows
# a run of at most this many characters per gap: enough for a newline and deep indentation.
MAX_JSON_WHITESPACE = 24
_BOUNDED_WHITESPACE = {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"}
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
COMPILED_CACHE_SIZE = 64  # distinct constraints kept compiled (equal requests reuse them)
COMPILE_THREADS = 2


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a dependency; only a broken install lacks it
        raise StructuredOutputError(
            "structured outputs need the llguidance package (pip install llguidance)"
        ) from None
    return llguidance


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (not yet compiled against a vocabulary)."""
    llg = _llguidance()
    kind = spec.kind
    try:
        if kind in ("json_schema", "json_object"):
            schema = spec.json_schema if kind == "json_schema" else {"type": "object"}
            options = _COMPACT if spec.whitespace == "compact" else _BOUNDED_WHITESPACE
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            # Lark string literals take JSON's escapes.
            return llg.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            )
        text = spec.grammar
        if "::=" in text:  # llama.cpp's GBNF
            from llguidance.gbnf_to_lark import any_to_lark

            text = any_to_lark(text)
        return llg.LLMatcher.grammar_from_lark(text)
    except StructuredOutputError:
        raise
    except Exception as exc:  # gguf's converter and the schema reader raise ValueError
        raise StructuredOutputError(f"{kind}: {one_line(exc)}") from None


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: a pristine matcher that each sequence copies."""

    spec: StructuredOutputs
    template: Any  # llguidance.LLMatcher in its start state

    def new_matcher(self):
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary, from any thread.

    `tokenizer_json` is the `tokenizers` JSON of the model's tokenizer, or a function giving
    it when first needed (raw token bytes, so a
    GGUF's vocabulary works as a Hugging Face one does); `vocab_size` the logits' width;
    `eos_token_ids` the tokens that end a sequence (allowed once the grammar accepts).
    """

    def __init__(
        self,
        tokenizer_json: Callable[[], str | None] | str | None,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout_s: float,
    ) -> None:
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.timeout_s = timeout_s
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagecli-grammar")
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_lock = threading.Lock()

    @property
    def tokenizer(self):
        """llguidance's view of the vocabulary, built once on first use (~0.4 s for 49k)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                if callable(self.tokenizer_json):
                    self.tokenizer_json = self.tokenizer_json()
                if self.tokenizer_json is None:
                    raise StructuredOutputError(
                        "structured outputs need the model's tokenizer.json (a fast tokenizer)"
                    )
                llg = _llguidance()
                try:
                    self._tokenizer = llg.LLTokenizer(
                        self.tokenizer_json,
                        n_vocab=self.vocab_size,
                        eos_token=self.eos_token_ids or None,
                    )
                except Exception as exc:
                    raise StructuredOutputError(
                        f"structured outputs cannot read this tokenizer: {one_line(exc)}"
                    ) from None
            return self._tokenizer

    def special_ids(self, texts: list[str]) -> dict[str, int]:
        """The texts that are one special token of the vocabulary as llguidance reads it
        (every added token), by id; a grammar names those as tokens (`<[id]>`)."""
        tokenizer = self.tokenizer
        found = {}
        for text in texts:
            ids = tokenizer.tokenize_str(text, parse_special=True)
            if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
                found[text] = ids[0]
        return found

    def compile(self, spec: StructuredOutputs, timeout_s: float | None = None) -> CompiledGrammar:
        """The compiled constraint; StructuredOutputError when it is invalid, uses a keyword
        the compiler lacks, or takes longer than the time limit."""
        key = spec.key()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        text = grammar_text(spec)
        tokenizer = self.tokenizer  # its one-time build does not count against the limit
        limit = self.timeout_s if timeout_s is None else timeout_s
        future = self._pool.submit(_build_matcher, tokenizer, text)
        try:
            matcher = future.result(timeout=limit)
        except FutureTimeout:
            raise StructuredOutputError(
                f"{spec.kind}: the grammar did not compile within {limit:g} s"
            ) from None
        if matcher.is_error():
            raise StructuredOutputError(f"{spec.kind}: {one_line(matcher.get_error())}")
        compiled = CompiledGrammar(spec, matcher)
        with self._cache_lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILED_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _build_matcher(tokenizer, text: str):
    llg = _llguidance()
    # LLMatcher never raises for grammar errors: it enters its error state (checked above).
    return llg.LLMatcher(tokenizer, text, log_level=0)


def advance(matcher, token_id: int) -> str | None:
    """Feed the sampled token; returns "stop" when the grammar is complete (nothing but EOS
    may follow), "error" when the token broke it, else None."""
    if not matcher.consume_token(token_id):
        return "error"
    if matcher.is_stopped():
        return "stop"
    return None


def forced_tokens(matcher, limit: int) -> list[int]:
    """The tokens the grammar forces next (llguidance's fast-forward tokens: the canonical
    tokens of the bytes that must come), at most `limit`: drafts that cost nothing to
    propose. Other tokenizations of the same bytes may be allowed too, so they are checked
    like any draft."""
    if limit < 1 or matcher.is_stopped():
        return []
    return list(matcher.compute_ff_tokens()[:limit])


class BitmaskFiller:
    """Fills the token bitmask of a step's constrained rows on its own thread, so that it
    overlaps the forward pass, and applies it to the logits after.

    One row per sampled sequence that has a matcher, and one more per draft it carries (the
    grammar's state after the drafts before it); llguidance's executor computes the rows of
    sequences without drafts in parallel (it releases the GIL)."""

    def __init__(self, vocab_size: int, num_threads: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.num_threads = max(1, num_threads)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagecli-mask")
        self._executor = None
        self._buffer = np.empty((0, self.num_words), dtype=np.int32)

    def _llg_executor(self):
        if self._executor is None:
            self._executor = _llguidance().LLExecutor(num_threads=self.num_threads)
        return self._executor

    def start(self, entries: list[tuple[int, Any, list[int]]]) -> Future:
        """Begin filling: `entries` holds (first row of the logits, matcher, drafts), the
        drafts' rows following the first. Returns a future of (rows, mask [R, W] int32)."""
        num_rows = sum(1 + len(drafts) for _, _, drafts in entries)
        if num_rows > len(self._buffer):
            self._buffer = np.empty(
                (max(num_rows, 2 * len(self._buffer)), self.num_words), dtype=np.int32
            )
        return self._thread.submit(self._fill, entries, num_rows)

    def _fill(self, entries: list[tuple[int, Any, list[int]]], num_rows: int):
        mask = self._buffer[:num_rows]
        plain = [(row, m) for row, m, drafts in entries if not drafts]
        if len(plain) == 1:
            plain[0][1].unsafe_compute_mask_ptr(mask[0].ctypes.data, mask[0].nbytes)
        elif plain:
            self._llg_executor().unsafe_compute_mask_ptr(
                [(m, i) for i, (_, m) in enumerate(plain)],
                mask.ctypes.data,
                self.num_words * 4,
                len(plain),
            )
        rows = [row for row, _ in plain]
        i = len(plain)
        for first, matcher, drafts in entries:
            if not drafts:
                continue
            consumed = 0  # the grammar walks the drafts, then goes back
            for j in range(len(drafts) + 1):
                out = mask[i]
                if consumed == j:
                    matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
                else:  # past a draft the grammar refuses: that draft is rejected
                    out.fill(-1)
                rows.append(first + j)
                i += 1
                if j < len(drafts) and consumed == j and matcher.consume_token(drafts[j]):
                    consumed += 1
            if consumed:
                matcher.rollback(consumed)
        return rows, mask

    @staticmethod
    def apply(logits: torch.Tensor, filled: Future) -> None:
        """Wait for the mask and set every token it forbids to -inf, in place."""
        from pagecli_kernels import ops

        rows, mask = filled.result()
        index = torch.tensor(rows, dtype=torch.long)
        words = torch.from_numpy(mask)
        if logits.device.type != "cpu":
            index, words = index.to(logits.device), words.to(logits.device, non_blocking=True)
        ops.apply_token_bitmask_(logits, words, index)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
