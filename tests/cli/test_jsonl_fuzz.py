"""Property tests of what `pagecli generate` does with any input: arbitrary bytes and
arbitrary JSON values per line give exactly one output record per non-blank line and never an
exception, native and OpenAI batch lines alike; lines are read with a bounded size.

The parser functions are tested directly (fast); test_hostile.py runs the real command once
over a sample of such lines.
"""

from __future__ import annotations

import io
import json
import math

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from pagecli.batch.files import LongLine, read_lines
from pagecli.batch.jsonl import (
    KNOWN_FIELDS,
    BadLine,
    Job,
    encode_record,
    error_record,
    parse_line,
)
from pagecli.outputs import CompletionOutput, RequestOutput
from tests.sizes import size

DEFAULTS = {"max_tokens": 8, "temperature": 0.0}
SETTINGS = settings(
    max_examples=size(100, 300), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# JSON values as Python's json module reads them (NaN and Infinity included: it accepts them).
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "\u2028", "\x85", "\ud800", "POST", "/v1/completions", "user"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
field_names = st.sampled_from(sorted(KNOWN_FIELDS)) | st.text(max_size=8)
# Objects with the record's own field names, so that the parser goes past its first checks.
native_objects = st.dictionaries(field_names, json_values, max_size=5)
messages = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "name"]), json_values, max_size=3)
    | json_values,
    max_size=3,
)
batch_bodies = st.dictionaries(
    st.sampled_from(
        [
            "messages",
            "prompt",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "n",
            "stream",
            "logprobs",
            "model",
            "seed",
            "stop",
            "tools",
        ]
    )
    | st.text(max_size=6),
    json_values | messages,
    max_size=5,
)
batch_objects = st.fixed_dictionaries(
    {"custom_id": json_values | st.text(max_size=6), "body": batch_bodies | json_values},
    optional={
        "method": st.sampled_from(["POST", "GET"]) | json_values,
        "url": st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/x"]) | json_values,
        "extra": json_values,
    },
)


def encode_json(value) -> bytes:
    """A value as one JSON line; lone surrogates become escapes, as another writer's would."""
    return json.dumps(value).encode()


def answer(raw: bytes, line: int = 5) -> dict | None:
    """What generate writes for one input line before any engine work: the error record of a
    bad line, a stand-in result for a job (the engine's part is tested elsewhere)."""
    item = parse_line(raw, line, DEFAULTS, system="Be brief.")
    if item is None:
        return None
    assert isinstance(item, (Job, BadLine))
    assert item.line == line
    if isinstance(item, BadLine):
        return error_record(item, item.message)
    assert isinstance(item.prompt, (str, list, dict))
    output = RequestOutput(
        "0", None, [1, 2], [CompletionOutput(0, "ok\u2028", [3], "stop")], finished=True
    )
    from pagecli.batch.jsonl import result_record

    return result_record(item, output, "model")


def check_one_strict_line(record: dict) -> None:
    """The record encodes to one line, for every line splitter, of strict JSON."""
    data = encode_record(record)
    text = data.decode("utf-8")
    assert text.endswith("\n") and len(text.splitlines()) == 1

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    back = json.loads(text, parse_constant=no_constants)
    assert isinstance(back, dict)


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_give_one_record_per_non_blank_line(raw):
    raw = raw.replace(b"\n", b" ")  # one line
    record = answer(raw)
    blank = not raw.decode("utf-8", "replace").strip()
    if raw.strip() and not blank:
        assert record is not None
        check_one_strict_line(record)
    elif record is not None:  # whitespace by byte but not by Unicode, or invalid UTF-8
        check_one_strict_line(record)


@SETTINGS
@given(json_values)
def test_arbitrary_json_values_give_one_record(value):
    record = answer(encode_json(value))
    assert record is not None
    check_one_strict_line(record)
    if not isinstance(value, dict):
        assert record["error"] is not None


@SETTINGS
@given(native_objects)
def test_native_objects_give_one_record(obj):
    record = answer(encode_json(obj))
    assert record is not None
    check_one_strict_line(record)
    if record["error"] is not None and "custom_id" not in record:
        assert record["error"]["line"] == 5


@SETTINGS
@given(batch_objects)
def test_openai_batch_lines_give_one_record(obj):
    record = answer(encode_json(obj))
    assert record is not None
    check_one_strict_line(record)
    if isinstance(obj["custom_id"], str):
        assert record["custom_id"] == obj["custom_id"]  # answered in the batch format
        if record["error"] is not None:
            assert record["error"]["line"] == 5


@SETTINGS
@given(st.lists(st.binary(max_size=40), max_size=12), st.integers(1, 30), st.integers(1, 17))
def test_read_lines_splits_and_bounds(lines, max_line_bytes, chunk_bytes):
    """Every line once, in order; those over the limit as LongLine with their length."""
    lines = [line.replace(b"\n", b"") for line in lines]
    data = b"\n".join(lines) + (b"\n" if lines else b"")
    got = list(read_lines(io.BytesIO(data), max_line_bytes, chunk_bytes))
    expected = [LongLine(len(x)) if len(x) > max_line_bytes else x for x in lines]
    assert got == expected


def test_read_lines_last_line_without_newline():
    assert list(read_lines(io.BytesIO(b"a\n\nbc"), 8)) == [b"a", b"", b"bc"]
    assert list(read_lines(io.BytesIO(b"a\nbcdefghij"), 3)) == [b"a", LongLine(9)]


def test_read_lines_keeps_memory_bounded():
    """A 50 MB line is dropped chunk by chunk: what is held stays near the limit."""
    import tracemalloc

    class Source:
        def __init__(self, size: int) -> None:
            self.left = size

        def read1(self, n: int) -> bytes:
            if self.left < 0:
                return b""
            n = min(n, self.left)
            self.left -= n
            if n == 0:
                self.left = -1
                return b"\n"
            return b"a" * n

    tracemalloc.start()
    try:
        got = list(read_lines(Source(50 * 2**20), 2**20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [LongLine(50 * 2**20)]
    assert peak < 4 * 2**20, peak


def test_encode_record_escapes_line_separators():
    """U+2028 and U+2029 (and U+0085) in text would cut a record in two for splitlines()."""
    text = "\n\u2028sea\u2029waves\x85foam"
    data = encode_record({"id": 1, "text": text, "error": None})
    assert b"\\u2028" in data and b"\\u2029" in data and b"\\u0085" in data
    lines = data.decode().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["text"] == text


def test_non_finite_ids_are_refused():
    for raw in (b'{"id": NaN, "prompt": "x"}', b'{"id": -Infinity, "prompt": "x"}'):
        bad = parse_line(raw, 2, DEFAULTS)
        assert isinstance(bad, BadLine) and "finite" in bad.message
        assert not math.isnan(bad.id) and bad.id == 2


def test_hostile_json_is_a_bad_line():
    """Nesting past the recursion limit and integers past Python's digit limit."""
    for raw in (b"[" * 100_000, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"):
        bad = parse_line(raw, 3, DEFAULTS)
        assert isinstance(bad, BadLine) and "JSON" in bad.message
