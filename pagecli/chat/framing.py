"""How chat input becomes messages: one per non-blank line, or a block between lines that
start and end with triple quotes (the piped mode and the terminal's Enter key share it)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional

FENCE = '"""'


def messages(lines: Iterable[str]) -> Iterator[str]:
    """User messages from input lines: one per non-blank line, or a block between lines that
    start and end with triple quotes."""
    block: Optional[list[str]] = None
    for line in lines:
        line = line.rstrip("\r\n")
        if block is not None:
            if line.rstrip().endswith(FENCE):
                block.append(line.rstrip()[: -len(FENCE)])
                yield "\n".join(block).strip("\n")
                block = None
            else:
                block.append(line)
        elif line.strip().startswith(FENCE) and not is_closed_block(line):
            block = [line.strip()[len(FENCE) :]]
        elif line.strip():
            yield unfence(line)
    if block is not None and "\n".join(block).strip():
        yield "\n".join(block).strip("\n")


def is_closed_block(text: str) -> bool:
    """False for text that opens a triple-quoted block and has not closed it yet."""
    text = text.strip()
    if not text.startswith(FENCE):
        return True
    return len(text) >= 2 * len(FENCE) and text.endswith(FENCE)


def unfence(text: str) -> str:
    """The message inside a closed triple-quoted block (other text as it is)."""
    stripped = text.strip()
    if stripped.startswith(FENCE) and is_closed_block(stripped):
        return stripped[len(FENCE) : -len(FENCE)].strip("\n")
    return text.strip()
