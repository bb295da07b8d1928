"""Tokenizer, chat templates and incremental detokenization."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from pagecli.errors import PromptTooLongError
from pagecli.loader.resolve import ModelLoadError, converted_tokenizer_backend

# For models that ship no chat template (base models such as Llama-2-7b-hf): each message on
# its own lines, the role as a header, then the assistant header to continue from.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Text that may not fit is tokenized in growing prefixes first: the first holds this many
# characters per allowed token (more than most text has), each next one twice as many, so the
# work done on text too long to fit is proportional to the limit, not to the text.
PREFIX_CHARS_PER_TOKEN = 4
# Tokens that cutting a prefix can add over the same characters inside the whole text (the
# word at the cut tokenized in two parts).
CUT_TOKENS = 16


class Tokenizer:
    """A transformers tokenizer with the chat template resolved once. `hf` is transformers'
    tokenizer, or for a converted GGUF that its conversion found reproduced by the
    `tokenizers` library alone, a LightTokenizer (loader/light_tokenizer.py: same ids, no
    transformers import)."""

    def __init__(self, folder: Path, name: str, chat_template: str | None = None) -> None:
        try:
            self.hf = _load(Path(folder))
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(f"{name}: cannot load the tokenizer ({first})") from None
        self.template_source = "model"
        if chat_template is not None:
            try:
                self.hf.chat_template = Path(chat_template).read_text()
            except OSError as exc:
                raise ModelLoadError(
                    f"{chat_template}: cannot read chat template ({exc.strerror})"
                ) from None
            self.template_source = "file"
        elif not getattr(self.hf, "chat_template", None):
            self.hf.chat_template = FALLBACK_CHAT_TEMPLATE
            self.template_source = "fallback"
            print(
                f"pagecli: {name} has no chat template; using the plain fallback "
                "('Role: text' lines; --chat-template FILE overrides)",
                file=sys.stderr,
            )

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(
        self, text: str, max_tokens: int | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of `text`. With `max_tokens`, text that has more raises PromptTooLongError,
        found from prefixes of it: the cost is bounded by the limit, whatever the text's size."""
        if max_tokens is not None:
            self.check_length(text, max_tokens, add_special_tokens)
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def check_length(self, text: str, max_tokens: int, add_special_tokens: bool = True) -> None:
        """Raise PromptTooLongError when a prefix of `text` already has more than `max_tokens`
        tokens; text short enough to be tokenized whole passes unchecked."""
        size = PREFIX_CHARS_PER_TOKEN * (max(max_tokens, 0) + CUT_TOKENS)
        while size < len(text):
            num_tokens = len(self.hf.encode(text[:size], add_special_tokens=add_special_tokens))
            if num_tokens > max_tokens + CUT_TOKENS:
                raise PromptTooLongError(len(text), max_tokens)
            size *= 2

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation as the template renders it; `tools` (OpenAI tool dicts) go to the
        template's own `tools` variable, as transformers passes them."""
        extra = {"tools": tools} if tools else {}
        return self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation. The template already holds any BOS, so no
        special tokens are added again. `max_tokens` bounds the work as in `encode`."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, max_tokens, add_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def backend_json(self) -> str | None:
        """The `tokenizers` JSON of a fast tokenizer (what llguidance reads the vocabulary's
        raw bytes from); None for a slow one."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return None
        import copy

        backend = copy.copy(backend)  # the engine's own keeps its settings
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def vocab(self) -> dict[str, int]:
        """Every token, added ones too, by id."""
        return _vocab_of(self.hf)


def load_vocab(folder: Path, name: str) -> dict[str, int]:
    """The vocabulary of the tokenizer in `folder` (a draft model's, checked against its
    target's) without a chat template or its fallback notice."""
    try:
        return _vocab_of(_load(Path(folder)))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{name}: cannot load the tokenizer ({first})") from None


def _vocab_of(hf) -> dict[str, int]:
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        return backend.get_vocab(with_added_tokens=True)
    return hf.get_vocab()


def _load(folder: Path):
    """The folder's tokenizer: a LightTokenizer where the GGUF conversion marked it so."""
    if converted_tokenizer_backend(folder) == "tokenizers":
        from pagecli.loader.light_tokenizer import LightTokenizer

        if LightTokenizer.suits(folder):  # still (the folder may have been edited since)
            return LightTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


class IncrementalDetokenizer:
    """Streams the text of a growing list of token ids.

    Text is emitted once it decodes to complete characters; the concatenation of the deltas
    equals `tokenizer.decode(all_ids)` (the window always starts at a token that was decoded
    before, so leading-space handling is the same as in the full decode).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        keep_token_ids: Iterable[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep_token_ids = frozenset(keep_token_ids)  # special tokens kept in the text even so
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens up to here are already in `text`

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the new text that is complete so far."""
        self.token_ids.extend(new_token_ids)
        decode = self._decode_keeping if self.keep_token_ids else self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix_text = decode(self.token_ids[self._prefix_offset : self._read_offset], skip)
        full_text = decode(self.token_ids[self._prefix_offset :], skip)
        if full_text.endswith("\ufffd") or len(full_text) < len(prefix_text):
            return ""  # an incomplete multi-byte character: wait for more tokens
        if not full_text.startswith(prefix_text):
            # Decoding is not prefix-stable here (rare normalisations): fall back to a full decode.
            whole = decode(self.token_ids, skip)
            delta = whole[len(self.text) :] if whole.startswith(self.text) else ""
        else:
            delta = full_text[len(prefix_text) :]
        self.text += delta
        # The next window starts at the first token of this delta: already decoded.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return delta

    def _decode_keeping(self, token_ids: list[int], skip: bool) -> str:
        """Decode with special tokens skipped (when `skip`) except the kept ones: the runs
        between kept tokens decode as usual, each kept token as its own text."""
        if not skip:
            return self.tokenizer.decode(token_ids, False)
        parts, run = [], []
        for token_id in token_ids:
            if token_id in self.keep_token_ids:
                parts.append(self.tokenizer.decode(run, True))
                parts.append(self.tokenizer.decode([token_id], False))
                run = []
            else:
                run.append(token_id)
        parts.append(self.tokenizer.decode(run, True))
        return "".join(parts)
