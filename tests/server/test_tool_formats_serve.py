"""Tool calls through `pagecli serve` and the `openai` client for every call format, on a
vocabulary whose tags are single special tokens as in the real families (Qwen's
`<tool_call>`, Mistral's `[TOOL_CALLS]`/`[ARGS]`, Llama 3.1's `<|python_tag|>`;
tests/tool_tokenizer.py): forced calls (required, named, one only) whole and streamed, calls
the model writes itself with text around them, replies that make no call, and a tool's result
rendered into the next turn (Mistral's templates refuse any call id but nine letters and
digits)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import jsonschema
import openai
import pytest

from pagecli.outputs import CompletionOutput
from pagecli.server.responses import ResponseFormat
from tests.server.conftest import Server, streamed_chat
from tests.sizes import FULL
from tests.tool_tokenizer import TAGS, tool_model_dir

TEMPLATES = Path(__file__).parent / "templates"
FORMS = {  # the server's template, and what its replies are read as
    "hermes": "hermes.jinja",
    "llama3_json": "llama3.jinja",
    "mistral": "mistral.jinja",
    "mistral_args": "mistral_args.jinja",
    "qwen3_coder": "qwen3_coder.jinja",
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Rome, in celsius?"}]
ROME = {"city": "Rome", "unit": "celsius"}


SERVE_ARGS = ["--kv-cache-memory", "0.5", "--grammar-timeout", "10", "--no-prefix-caching"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per format, all started at once: their start-ups (mostly one thread each)
    overlap instead of running one after another. Without prefix caching: the tests send one
    prompt twice and compare the replies, and a prefix hit would run the second prefill in
    other batch shapes (on a CPU with AVX512_BF16, `--dtype auto` is bfloat16, whose products
    then round differently and led the two greedy replies apart after a few tokens)."""
    started = {}
    try:
        for name, template in FORMS.items():
            folder = tool_model_dir(tmp_path_factory.mktemp(name) / "model", TEMPLATES / template)
            started[name] = Server(
                ["--model", str(folder), *SERVE_ARGS],
                wait=False,
            )
        for srv in started.values():
            srv.wait_healthy()
        yield started
    finally:  # all asked to stop first, then each waited for: they shut down together
        for srv in started.values():
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGTERM)
        for srv in started.values():
            srv.stop(None)


@pytest.fixture(params=list(FORMS))
def served(request, servers):
    return request.param, servers[request.param]


def id_ok(name: str, call_id: str) -> bool:
    pattern = r"[A-Za-z0-9]{9}" if name.startswith("mistral") else r"call_[0-9a-f]{24}"
    return re.fullmatch(pattern, call_id) is not None


def test_forced_calls_whole_and_streamed(served):
    name, srv = served
    client = srv.client()
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = [("required", {}), (named, {})]
    if FULL:  # one call at most, asked for in a third way
        choices.insert(1, ("required", {"parallel_tool_calls": False}))
    else:  # the CI size: required and named alternate over the formats
        choices = [choices[list(FORMS).index(name) % 2]]
    for choice, extra in choices:
        kwargs = dict(
            model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
            temperature=0, max_tokens=120, **extra,
        )  # fmt: skip
        reply = client.chat.completions.create(**kwargs)
        choice0 = reply.choices[0]
        assert choice0.finish_reason == "tool_calls", (name, choice, choice0)
        calls = choice0.message.tool_calls
        assert calls and choice0.message.content is None
        for call in calls:
            assert call.type == "function" and id_ok(name, call.id), call.id
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice == named or extra:
            assert len(calls) == 1
        if choice == named:
            assert calls[0].function.name == "get_weather"
        content, stream_calls, finish = streamed_chat(client, **kwargs)
        assert finish == ["tool_calls"] and not content.strip()
        assert [(c["name"], json.loads(c["arguments"])) for c in stream_calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]
        assert all(id_ok(name, c["id"]) for c in stream_calls)


def written(name: str, lead: str, calls: list[tuple[str, dict]]) -> str:
    """A grammar forcing the model to write `lead` and `calls` as the family does, each tag
    as its special token (what a model trained on the format writes)."""

    def text(s: str) -> str:
        return json.dumps(s)

    def tag(t: str) -> str:
        return f"<[{TAGS[t]}]>"

    parts = [text(lead)] if lead else []
    if name == "hermes":
        for i, (n, a) in enumerate(calls):
            body = json.dumps({"name": n, "arguments": a})
            parts += [text("\n")] if i else []
            parts += [tag("<tool_call>"), text(f"\n{body}\n"), tag("</tool_call>")]
    elif name == "qwen3_coder":
        for n, a in calls:
            params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
            xml = f"\n<function={n}>\n{params}</function>\n"
            parts += [tag("<tool_call>"), text(xml), tag("</tool_call>")]
    elif name == "llama3_json":
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
        parts += [tag("<|python_tag|>"), text(body)]
    elif name == "mistral":
        parts += [tag("[TOOL_CALLS]"), text(" " + json.dumps(
            [{"name": n, "arguments": a} for n, a in calls]))]  # fmt: skip
    else:
        for n, a in calls:
            parts += [tag("[TOOL_CALLS]"), text(n), tag("[ARGS]"), text(json.dumps(a))]
    return "start: " + " ".join(parts) + "\n"


def test_calls_the_model_writes_are_read_back(served):
    """tool_choice auto: the reply (forced here by a grammar) carries text and two calls; the
    tags, special tokens, stay in the text that the parser reads, whole and streamed."""
    name, srv = served
    client = srv.client()
    model = client.models.list().data[0].id
    lead = "" if name == "llama3_json" else "Let me look."  # llama3's JSON opens the reply
    calls = [("get_weather", ROME), ("get_time", {"zone": "CET"})]
    kwargs = dict(
        model=model, messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
        extra_body={"structured_outputs": {"grammar": written(name, lead, calls)}},
    )  # fmt: skip
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", (name, message)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == (
        calls
    )
    assert (message.content or "").strip() == lead  # (with the newline between two calls)
    content, stream_calls, finish = streamed_chat(client, **kwargs)
    assert finish == ["tool_calls"] and content == (message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in stream_calls] == calls


def test_a_reply_without_a_call_is_untouched(served):
    """tool_choice auto checks a call only once the model opens one: a reply that makes none
    is the same as with tool_choice none (same prompt, greedy)."""
    name, srv = served
    client = srv.client()
    model = client.models.list().data[0].id
    replies = [
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=choice,
            temperature=0,
            max_tokens=24,
        )  # fmt: skip
        for choice in ("auto", "none")
    ]
    auto, none = (r.choices[0] for r in replies)
    assert auto.message.tool_calls is None and auto.finish_reason == none.finish_reason
    assert auto.message.content == none.message.content, name


def test_auto_answers_even_when_a_schema_cannot_be_checked(served):
    """A tool schema the grammar compiler lacks (uniqueItems) refuses a forced call with a 400
    naming it; with tool_choice auto the reply is still made, its calls parsed unchecked."""
    name, srv = served
    client = srv.client()
    model = client.models.list().data[0].id
    unique = {"type": "array", "uniqueItems": True}
    parameters = {"type": "object", "properties": {"tags": unique}}
    odd = {"type": "function", "function": {"name": "tag", "parameters": parameters}}
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=[odd], temperature=0, max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length"), name
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=ASK, tools=[odd], tool_choice="required", max_tokens=8
        )
    assert "uniqueItems" in info.value.message and info.value.body["param"] == "tool_choice"


def test_a_tool_result_goes_into_the_next_turn(served):
    name, srv = served
    client = srv.client()
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=80, extra_body={"parallel_tool_calls": False},
    )  # fmt: skip
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Rome: 21 degrees, sunny"},
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], temperature=0, max_tokens=16
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its result are in the prompt: it grew by more than the result's words
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 8, name


def test_a_grammar_that_cannot_go_on_says_why():
    """A choice that ends in "error" carries a message: never a silent short reply."""
    fmt = ResponseFormat("chat", "chatcmpl-1", "m", None)
    out = CompletionOutput(index=0, text="<tool_call>", token_ids=[151657],
                           finish_reason="error", stop_reason="grammar")  # fmt: skip
    choice = fmt.full_choice(0, out)
    assert choice["finish_reason"] == "error"
    assert "grammar" in choice["error"]["message"] and "1 tokens" in choice["error"]["message"]
