"""Reading the files of `pagecli generate` with bounded memory: input lines under a size cap
(a longer one is dropped as it streams by), and the output file of an earlier run for
`--resume` (the ids it answers, the lines that are not records)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from pagecli.batch.jsonl import id_key, is_valid_id, json_type

DEFAULT_MAX_LINE_BYTES = 8 * 2**20
READ_CHUNK_BYTES = 2**16


@dataclass
class LongLine:
    """An input line longer than the limit: skipped as it streamed by, never held whole."""

    num_bytes: int  # its length without the newline


def read_lines(
    source: BinaryIO, max_line_bytes: int, chunk_bytes: int = READ_CHUNK_BYTES
) -> Iterator[bytes | LongLine]:
    """The lines of `source` without their newline; a line over `max_line_bytes` comes out as
    a LongLine, after its bytes were read and dropped. Memory stays within about
    max_line_bytes + chunk_bytes whatever the input. Each read returns what has arrived
    (`read1`), so a producer that waits for an answer before writing more is served."""
    read = source.read1 if hasattr(source, "read1") else source.read
    parts: list[bytes] = []
    size = 0  # bytes of the current line so far, dropped ones included

    def add(piece: bytes) -> None:
        nonlocal size
        size += len(piece)
        if size > max_line_bytes:
            parts.clear()
        elif piece:
            parts.append(piece)

    def take() -> bytes | LongLine:
        nonlocal size
        line = LongLine(size) if size > max_line_bytes else b"".join(parts)
        parts.clear()
        size = 0
        return line

    while chunk := read(chunk_bytes):
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            add(chunk[start:end])
            yield take()
            start = end + 1
        add(chunk[start:])
    if size:  # a last line without its newline
        yield take()


@dataclass
class ResumeState:
    """What the output file of an earlier run holds, for `--resume`."""

    done: set[str] = field(default_factory=set)  # id_keys of records answered without error
    bad_lines: list[tuple[int, str]] = field(default_factory=list)  # (line, why not a record)


def read_resume_state(path: Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> ResumeState:
    """Read `path` line by line (never whole). A last line cut short (a killed writer) is
    removed from the file so that appending starts on a fresh line. Lines that are not
    records are kept in the file and listed in `bad_lines`; they answer no id."""
    state = ResumeState()
    with path.open("r+b") as f:
        end = _end_of_last_line(f)
        if end < f.seek(0, 2):
            f.truncate(end)
        f.seek(0)
        for line, raw in enumerate(read_lines(f, max_line_bytes), start=1):
            why = None
            if isinstance(raw, LongLine):
                why = f"a line of {raw.num_bytes} bytes"
            else:
                record, why = _output_record(raw)
                if record is not None and record["error"] is None:
                    key = "custom_id" if "custom_id" in record else "id"
                    state.done.add(id_key(record[key]))
            if why is not None:
                state.bad_lines.append((line, why))
    return state


def _end_of_last_line(f: BinaryIO, chunk_bytes: int = READ_CHUNK_BYTES) -> int:
    """The offset just past the file's last newline (0 when it has none)."""
    pos = f.seek(0, 2)
    while pos > 0:
        start = max(0, pos - chunk_bytes)
        f.seek(start)
        found = f.read(pos - start).rfind(b"\n")
        if found != -1:
            return start + found + 1
        pos = start
    return 0


def _output_record(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """An output line as (record, None), or (None, why it is not a record)."""
    if not raw.strip():
        return None, "a blank line"
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None, "not valid JSON"
    if not isinstance(record, dict):
        return None, f"{json_type(record)}, not an object"
    if "error" not in record:
        return None, "no error field"
    if "custom_id" in record and "response" in record:
        ok = isinstance(record["custom_id"], str)
    else:
        ok = is_valid_id(record.get("id"))
    return (record, None) if ok else (None, "no valid id or custom_id")
