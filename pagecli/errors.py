"""Errors a user can cause (a model that does not load, a request that cannot run, a bad
constraint, a server that refuses), importable without torch or the engine, so that the
commands and the server name them without importing engine internals; and `one_line`, how
any message is shown as the one line a user sees."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model cannot be found or read; the message is one line naming the source and why."""


class SplitError(ModelLoadError):
    """The model cannot be split over this many ranks (one line, with the sizes that work)."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one pagecli implements, or its config asks for
    something the family's implementation lacks (the message says what)."""


class GGUFError(ValueError):
    """The file is not a GGUF model pagecli can read."""


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the message says where)."""


class KVCacheMemoryError(ValueError):
    """The KV cache (and swap space) asked for does not fit the memory that is available."""


class PromptTooLongError(ValueError):
    """Text with more tokens than allowed, found by tokenizing a prefix of it."""

    def __init__(self, num_chars: int, max_tokens: int) -> None:
        super().__init__(f"prompt of {num_chars} characters has more than {max_tokens} tokens")
        self.num_chars = num_chars
        self.max_tokens = max_tokens


class RequestError(ValueError):
    """A request the engine cannot run (too long for the context or the KV cache)."""


class GrammarRejected(RequestError):
    """A structured-output constraint that cannot run: invalid, unsupported or too slow to
    compile. The request is refused, never run unconstrained."""


class StructuredOutputError(ValueError):
    """A constraint that cannot run: bad syntax, an unsupported keyword, a compile time-out."""


class BackendError(Exception):
    """The backend cannot run anything (a model that does not load, a refused connection, a
    bad URL, a 401): the command ends in this one line."""


class RequestRejected(Exception):
    """This request failed and will not succeed as it is (a 4xx, a prompt too long, retries
    run out); the other requests go on. `status` is the HTTP status, where there was one;
    `num_prompt_tokens` the prompt's length, where it is known."""

    def __init__(self, message: str, status: int | None = None, num_prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.num_prompt_tokens = num_prompt_tokens


def one_line(exc: object, limit: int = 300) -> str:
    """A message on one line: the non-blank lines joined (a regex compiler's caret drawing
    left out), cut at `limit` characters; the exception's type when it says nothing."""
    parts = [line.strip() for line in str(exc).splitlines() if line.strip().strip("^")]
    text = " ".join(parts) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
