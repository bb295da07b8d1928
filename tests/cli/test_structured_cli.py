"""Structured outputs from the command line: `pagecli generate` with --json-schema and with
per-record constraints (`structured`, OpenAI's `response_format`, vLLM's `structured_outputs`),
chat's `/set format` and `/set schema`, and the request body `--endpoint` sends."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest

from pagecli.backends.base import Request
from pagecli.backends.remote import RemoteBackend
from pagecli.batch.jsonl import BadLine, Job, parse_line
from pagecli.chat.commands import constraint_text
from pagecli.chat.console import Chat
from pagecli.chat.state import DATA_DIR_ENV, ChatState
from pagecli.openai.protocol import structured_body
from pagecli.sampling_params import SamplingParams, StructuredOutputs
from tests.cli.helpers import jsonl, no_traceback, records, run

CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "color": {"enum": ["black", "white", "orange", "grey"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "color", "age"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "job": {"enum": ["doctor", "teacher", "farmer"]},
    },
    "required": ["name", "job"],
}
UNCOMPILABLE = {"type": "array", "uniqueItems": True}
GREEDY = ["--temperature", "0", "--max-tokens", "200", "--kv-cache-memory", "0.25"]
DEFAULTS = {"max_tokens": 8, "temperature": 0.0}


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


# ---- generate: one run over every kind of record -------------------------------------------


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """`pagecli generate --json-schema CAT` over records that keep, replace or break it."""
    schema = write_json(tmp_path_factory.mktemp("schema") / "cat.json", CAT)
    hi = [{"role": "user", "content": "Tell me about a person."}]
    strict_person = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    stdin = jsonl(
        {"id": "cat-1", "prompt": "Describe a cat as JSON:"},
        {"id": "cat-2", "messages": [{"role": "user", "content": "Invent a cat."}]},
        {"id": "cat-3", "prompt": "A cat called Tom, as JSON:"},
        {"id": "cat-4", "prompt": "My old grey cat:"},
        {
            "id": "person",
            "messages": hi,
            "response_format": strict_person,
        },
        {"id": "digits", "prompt": "A number:", "structured_outputs": {"regex": "[0-9]{3}"}},
        {"id": "unique", "prompt": "A list:", "structured": {"json_schema": UNCOMPILABLE}},
        {
            "id": "both",
            "prompt": "x",
            "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"},
        },
        {"id": "bad-kind", "prompt": "x", "response_format": {"type": "xml"}},
        {"id": "bad-value", "prompt": "x", "structured": 5},
        {
            "custom_id": "batch",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": hi, "response_format": strict_person},
        },
        {"id": "free", "prompt": "Hello", "response_format": {"type": "text"}, "max_tokens": 4},
    )
    proc = run(["generate", *GREEDY, "--json-schema", str(schema)], stdin)
    no_traceback(proc.stderr)
    return proc, {r.get("custom_id", r.get("id")): r for r in records(proc.stdout)}


def test_every_record_is_answered_and_errors_do_not_stop_the_run(generated):
    proc, out = generated
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stderr == b""
    assert len(out) == 12
    failed = {rid for rid, r in out.items() if r["error"] is not None}
    assert failed == {"unique", "both", "bad-kind", "bad-value"}


def test_json_schema_option_constrains_every_record(generated):
    _, out = generated
    for rid in ("cat-1", "cat-2", "cat-3", "cat-4"):
        assert out[rid]["finish_reason"] == "stop", out[rid]
        jsonschema.validate(json.loads(out[rid]["text"]), CAT)


def test_response_format_json_schema_replaces_the_default(generated):
    _, out = generated
    person = out["person"]
    assert person["finish_reason"] == "stop", person
    value = json.loads(person["text"])
    jsonschema.validate(value, PERSON)
    assert set(value) == {"name", "job"}  # strict: no other keys


def test_structured_outputs_regex(generated):
    _, out = generated
    assert out["digits"]["finish_reason"] == "stop"
    assert re.fullmatch(r"[0-9]{3}", out["digits"]["text"]), out["digits"]


def test_a_schema_that_does_not_compile_is_an_error_record(generated):
    _, out = generated
    error = out["unique"]["error"]
    assert out["unique"]["finish_reason"] == "error"
    assert "uniqueItems" in error["message"] and error["line"] == 7


def test_bad_constraint_fields_are_error_records_naming_them(generated):
    _, out = generated
    assert "response_format and structured_outputs" in out["both"]["error"]["message"]
    assert "response_format.type" in out["bad-kind"]["error"]["message"]
    assert "structured must be an object" in out["bad-value"]["error"]["message"]


def test_batch_lines_take_response_format(generated):
    _, out = generated
    batch = out["batch"]
    assert batch["error"] is None
    choice = batch["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_response_format_text_lifts_the_default(generated):
    _, out = generated
    free = out["free"]
    assert free["error"] is None and free["finish_reason"] == "length"
    assert not free["text"].lstrip().startswith("{")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "cannot read the JSON schema"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be an object"),
    ],
)
def test_a_bad_json_schema_file_ends_in_one_line(tmp_path, content, words):
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    proc = run(["generate", "--json-schema", str(path)], jsonl({"prompt": "x"}))
    no_traceback(proc.stderr)
    err = proc.stderr.decode()
    assert proc.returncode == 2
    assert proc.stdout == b""
    assert err.startswith(f"pagecli: {path}: ") and err.count("\n") == 1 and words in err


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_json_schema_the_engine_refuses_ends_in_one_line(tmp_path, command):
    """Refused once, before any record or message is read, not once per record."""
    path = write_json(tmp_path / "unique.json", UNCOMPILABLE)
    stdin = jsonl({"prompt": "x"}) if command == "generate" else b"hi\n"
    proc = run([command, "--json-schema", str(path), "--kv-cache-memory", "0.25"], stdin)
    no_traceback(proc.stderr)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and proc.stdout == b""
    assert err.startswith("pagecli: --json-schema: the engine refuses this constraint: ")
    assert "uniqueItems" in err and err.count("\n") == 1


# ---- the record parser ---------------------------------------------------------------------


def parse(record: dict, defaults=DEFAULTS) -> Job | BadLine:
    return parse_line(json.dumps(record).encode(), 1, defaults)


def test_record_constraint_spellings_map_to_structured():
    strict = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": PERSON, "strict": True},
    }
    job = parse({"prompt": "x", "response_format": strict})
    assert job.params.structured.json_schema == {**PERSON, "additionalProperties": False}
    job = parse({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert job.params.structured == StructuredOutputs(choice=["a", "b"])
    job = parse({"prompt": "x", "structured": {"regex": "a+", "whitespace": "compact"}})
    assert job.params.structured == StructuredOutputs(regex="a+", whitespace="compact")
    schema_default = {**DEFAULTS, "structured": {"json_schema": CAT}}
    assert parse({"prompt": "x"}, schema_default).params.structured.json_schema == CAT
    assert parse({"prompt": "x", "structured": None}, schema_default).params.structured is None


def test_record_constraint_errors_name_the_field():
    cases = [
        ({"structured": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs: regex"),
        ({"structured_outputs": {"jsn": {}}}, "unsupported field(s) jsn"),
        ({"response_format": "json"}, "response_format must be an object"),
        ({"structured": {"json_schema": {}, "regex": "a"}}, "exactly one of"),
    ]
    for fields, words in cases:
        item = parse({"prompt": "x", **fields})
        assert isinstance(item, BadLine) and words in item.message, (fields, item)


def test_a_strict_schema_nested_too_deeply_is_a_bad_record():
    schema: dict = {}
    for _ in range(400):  # under json's own nesting limit, over what strict mode can walk
        schema = {"type": "object", "properties": {"a": schema}}
    strict = {"type": "json_schema", "json_schema": {"name": "d", "schema": schema, "strict": True}}
    item = parse({"prompt": "x", "response_format": strict})
    assert isinstance(item, BadLine) and item.message == "response_format: nested too deeply"


# ---- chat ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from pagecli.backends.local import LocalBackend
    from pagecli.backends.sync import SyncBackend
    from pagecli.config import EngineConfig

    backend = SyncBackend(LocalBackend(EngineConfig(kv_cache_memory=0.25)))
    backend.start()
    yield backend
    backend.close()


def make_chat(llm) -> tuple[Chat, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    state = ChatState(llm, None, {"temperature": 0.0, "max_tokens": 100})
    return Chat(state, stdout=out, stderr=err), out, err


def replies(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_chat_set_format_json_and_text(llm):
    chat, out, err = make_chat(llm)
    chat.handle("/set format json")
    assert chat.state.current.sampling_params().structured == StructuredOutputs(json_object=True)
    chat.handle("Describe a cat.")
    assert isinstance(json.loads(out.getvalue()), dict)
    chat.handle("/params")
    chat.handle("/set format xml")
    chat.handle("/set structured {}")
    chat.handle("/set format text")
    assert chat.state.current.sampling_params().structured is None
    text = err.getvalue()
    assert "structured = any JSON object" in text  # /set, then /params
    assert "  structured = any JSON object" in text
    assert "error: usage: /set format json|text" in text
    assert "error: set the output constraint with /set format" in text
    assert "structured = none (free text)" in text
    assert chat.num_errors == 2
    no_traceback(text.encode())


def test_chat_set_schema_file_and_off(llm, tmp_path):
    chat, out, err = make_chat(llm)
    person = write_json(tmp_path / "person.json", {**PERSON, "additionalProperties": False})
    unique = write_json(tmp_path / "unique.json", UNCOMPILABLE)
    chat.handle(f"/set schema {person}")
    chat.handle("Who are you?")
    jsonschema.validate(json.loads(out.getvalue()), PERSON)
    chat.handle(f"/set schema {unique}")
    chat.handle(f"/set schema {tmp_path / 'missing.json'}")
    chat.handle("/set schema")
    assert chat.state.current.sampling_params().structured.json_schema["required"] == [
        "name",
        "job",
    ]  # the refused ones changed nothing
    chat.handle("/set schema off")
    assert chat.state.current.sampling_params().structured is None
    lines = [line for line in err.getvalue().splitlines() if line.startswith("error: ")]
    assert len(lines) == 3
    assert "uniqueItems" in lines[0]
    assert "missing.json: cannot read the JSON schema" in lines[1]
    assert "usage: /set schema FILE|off" in lines[2]
    assert 'structured = JSON schema {"type": "object"' in err.getvalue()


def test_chat_saved_parameters_keep_the_constraint(llm, tmp_path, monkeypatch):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "data"))
    chat, _, _ = make_chat(llm)
    schema = write_json(tmp_path / "cat.json", CAT)
    chat.handle(f"/set schema {schema}")
    path = chat.state.save(str(tmp_path / "s.json"))
    saved = json.loads(path.read_text())["parameters"]["structured"]
    assert saved["json_schema"] == CAT
    other, _, _ = make_chat(llm)
    other.state.load(str(path))
    assert other.state.current.sampling_params().structured == StructuredOutputs(json_schema=CAT)
    assert other.state.current.params == chat.state.current.params


def test_constraint_text():
    assert constraint_text(None) == "none (free text)"
    assert constraint_text({"json_object": True, "whitespace": "compact"}) == (
        "any JSON object, compact whitespace"
    )
    assert constraint_text({"regex": "[0-9]+"}) == "regex '[0-9]+'"
    assert constraint_text({"choice": ["yes", "no"]}) == "one of 'yes', 'no'"
    assert constraint_text({"grammar": 'start: "a"\n'}) == "grammar of 1 lines"
    long = constraint_text({"json_schema": CAT})
    assert long.startswith('JSON schema {"type": "object"') and long.endswith("…")


# ---- --endpoint: the request body ----------------------------------------------------------

SPECS = [
    StructuredOutputs(json_schema=CAT),
    StructuredOutputs(json_object=True),
    StructuredOutputs(json_schema=CAT, whitespace="compact"),
    StructuredOutputs(json_object=True, whitespace="compact"),
    StructuredOutputs(regex="[0-9]{3}"),
    StructuredOutputs(choice=["yes", "no"]),
    StructuredOutputs(grammar='start: "a"'),
]


def test_structured_body_fields():
    assert structured_body(SPECS[0]) == {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "schema", "schema": CAT},
        }
    }
    assert structured_body(SPECS[1]) == {"response_format": {"type": "json_object"}}
    assert structured_body(SPECS[2]) == {
        "structured_outputs": {"json": CAT, "disable_any_whitespace": True}
    }
    assert structured_body(SPECS[3]) == {
        "structured_outputs": {"json_object": True, "disable_any_whitespace": True}
    }
    assert structured_body(SPECS[4]) == {"structured_outputs": {"regex": "[0-9]{3}"}}
    assert structured_body(SPECS[5]) == {"structured_outputs": {"choice": ["yes", "no"]}}
    assert structured_body(SPECS[6]) == {"structured_outputs": {"grammar": 'start: "a"'}}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.whitespace}")
def test_structured_body_reads_back_as_the_same_constraint(spec):
    """What the client sends is what a server's parser (pagecli serve's) reads."""
    assert StructuredOutputs.from_openai(**structured_body(spec)) == spec


def test_remote_requests_carry_the_constraint():
    """The bodies RemoteBackend posts, seen by a mock transport; none without a constraint."""
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        choice = {"index": 0, "text": "123", "finish_reason": "stop"}
        if request.url.path.endswith("chat/completions"):
            choice = {"index": 0, "message": {"content": "{}"}, "finish_reason": "stop"}
        return httpx.Response(200, json={"choices": [choice]})

    async def post_all() -> list[str]:
        backend = RemoteBackend("http://server.test/v1", served_model="m")
        backend.client = httpx.AsyncClient(
            base_url=backend.url + "/", transport=httpx.MockTransport(handler)
        )
        chat = [{"role": "user", "content": "hi"}]
        texts = []
        for prompt, structured in [
            (chat, {"json_schema": CAT}),
            ("A number:", {"regex": "[0-9]{3}"}),
            ("plain", None),
        ]:
            params = SamplingParams(max_tokens=5, structured=structured)
            output = await backend.complete(Request("r", prompt, params))
            texts.append(output.text)
        await backend.aclose()
        return texts

    assert asyncio.run(post_all()) == ["{}", "123", "123"]
    assert bodies[0]["response_format"]["json_schema"]["schema"] == CAT
    assert "structured_outputs" not in bodies[0]
    assert bodies[1]["structured_outputs"] == {"regex": "[0-9]{3}"}
    assert "response_format" not in bodies[1]
    assert not {"response_format", "structured_outputs"} & set(bodies[2])
