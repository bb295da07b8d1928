"""Structured outputs and tool calls through `pagecli serve` and the `openai` client: JSON
schemas, regexes, a compile that overruns its limit, a mixed concurrent load, and parsed tool
calls (streamed and not) in the Hermes and Llama 3 formats, the output forced by the call
grammar or by a regex."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import jsonschema
import openai
import pytest

from pagecli.server import tool_calls
from tests.server.conftest import Server, streamed_chat

TEMPLATES = Path(__file__).parent / "templates"
GRAMMAR_TIMEOUT_S = 0.1

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
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
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def _server(template: str) -> Server:
    return Server(
        [
            "--chat-template",
            str(TEMPLATES / template),
            "--grammar-timeout",
            str(GRAMMAR_TIMEOUT_S),
            "--kv-cache-memory",
            "0.5",
        ]
    )


@pytest.fixture(scope="module")
def hermes():
    srv = _server("hermes.jinja")
    yield srv
    srv.stop()


def test_the_serve_flag_lists_the_parsers_formats():
    from pagecli.cli.serve import ToolCallFormat

    assert tuple(f.value for f in ToolCallFormat) == tool_calls.FORMATS


def test_response_format_json_schema_streamed_and_not(hermes):
    client = hermes.client()
    model = hermes_model(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for i in range(3):
        messages = [{"role": "user", "content": f"Describe person {i} as JSON."}]
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            response_format=fmt,
            temperature=0,
            max_tokens=200,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        chunks = client.chat.completions.create(
            model=model,
            messages=messages,
            response_format=fmt,
            temperature=0,
            max_tokens=200,
            stream=True,
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == choice.message.content


def hermes_model(client) -> str:
    return client.models.list().data[0].id


def test_structured_outputs_regex_choice_and_json_object(hermes):
    client = hermes.client()
    model = hermes_model(client)
    reply = client.chat.completions.create(
        model=model,
        messages=ASK,
        temperature=0.8,
        seed=3,
        max_tokens=30,
        extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}},
    )
    import re

    assert re.fullmatch("[0-9]{2}-[a-z]{3}", reply.choices[0].message.content)
    reply = client.completions.create(
        model=model,
        prompt="The answer is",
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert reply.choices[0].text in ("yes", "no")
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=150,
    )
    assert reply.choices[0].message.content.startswith("{")


def test_bad_constraints_are_400s_naming_the_problem(hermes):
    client = hermes.client()
    model = hermes_model(client)
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
            "uniqueItems",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(open"}}}, "regex"),
        ({"extra_body": {"structured_outputs": {"structural_tag": "x"}}}, "structural_tag"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                 "function": {"name": "nope"}}},
            "nope",
        ),
    ]  # fmt: skip
    for kwargs, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=5, **kwargs)
        assert words in info.value.message, (kwargs, info.value.message)


def test_a_compile_past_the_limit_is_a_400_and_the_server_goes_on(hermes):
    client = hermes.client()
    model = hermes_model(client)
    big = {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}@[a-z]+"} for i in range(8000)
        },
    }
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": big}},
        )
    assert time.perf_counter() - start < GRAMMAR_TIMEOUT_S + 1.0
    assert "did not compile within" in info.value.message
    reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"


def test_64_concurrent_requests_half_constrained(hermes):
    """Every constrained answer is valid; the unconstrained ones equal their output when they
    ran without the constrained ones."""
    client = hermes.async_client()
    model = hermes_model(hermes.client())
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def chat(i: int) -> list[dict]:
        return [{"role": "user", "content": f"Tell me about person number {i}."}]

    async def free(i: int) -> str:
        reply = await client.chat.completions.create(
            model=model, messages=chat(i), temperature=0, max_tokens=24
        )
        return reply.choices[0].message.content

    async def constrained(i: int) -> str:
        reply = await client.chat.completions.create(
            model=model, messages=chat(i), temperature=0.7, seed=i, max_tokens=200,
            response_format=fmt,
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    async def main():
        alone = await asyncio.gather(*(free(i) for i in range(32)))
        mixed = await asyncio.gather(
            *(free(i // 2) if i % 2 == 0 else constrained(i) for i in range(64))
        )
        return alone, mixed

    alone, mixed = asyncio.run(main())
    assert mixed[0::2] == alone
    for text in mixed[1::2]:
        jsonschema.validate(json.loads(text), PERSON)


def _check_weather_call(calls) -> dict:
    """The arguments of the one call, valid for get_weather."""
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("template", ["hermes", "llama3"])
def test_forced_tool_calls_come_back_parsed(template, hermes):
    srv = hermes if template == "hermes" else _server("llama3.jinja")
    try:
        client = srv.client()
        model = hermes_model(client)
        named = {"type": "function", "function": {"name": "get_weather"}}
        cases = [("required", {}), ("required", {"parallel_tool_calls": False}), (named, {})]
        for choice, extra in cases:
            kwargs = dict(
                model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                temperature=0, max_tokens=120, **extra,
            )  # fmt: skip
            reply = client.chat.completions.create(**kwargs)
            message = reply.choices[0].message
            assert reply.choices[0].finish_reason == "tool_calls"
            assert message.content is None
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
            for call in message.tool_calls:  # each call valid for its own tool
                jsonschema.validate(
                    json.loads(call.function.arguments), schemas[call.function.name]
                )
            if choice == named or extra:
                assert len(message.tool_calls) == 1
            if choice == named:
                _check_weather_call(message.tool_calls)
            content, streamed, finish = streamed_chat(client, **kwargs)
            assert finish == ["tool_calls"] and not content.strip()
            assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
                (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls
            ]
    finally:
        if srv is not hermes:
            srv.stop()


def test_auto_tool_calls_and_a_malformed_one(hermes):
    """With tool_choice auto the reply is read for calls; a regex forces the model's text."""
    client = hermes.client()
    model = hermes_model(client)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'  # noqa: E501
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    for text, parsed in ((good, True), (bad, False)):
        kwargs = dict(
            model=model, messages=ASK, tools=[WEATHER], max_tokens=80, temperature=0,
            extra_body={"structured_outputs": {"choice": [text]}},
        )  # fmt: skip
        reply = client.chat.completions.create(**kwargs)
        message = reply.choices[0].message
        content, streamed, finish = streamed_chat(client, **kwargs)
        if parsed:
            assert message.content is None
            assert _check_weather_call(message.tool_calls) == {"city": "Paris", "unit": "celsius"}
            assert reply.choices[0].finish_reason == "tool_calls" and finish == ["tool_calls"]
            assert [json.loads(c["arguments"]) for c in streamed] == [
                {"city": "Paris", "unit": "celsius"}
            ]
        else:  # never a guessed call: the text comes back as it was
            assert not message.tool_calls and message.content == bad
            assert reply.choices[0].finish_reason == "stop"
            assert content == bad and not streamed and finish == ["stop"]


def test_a_conversation_with_tool_results_renders(hermes):
    client = hermes.client()
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    reply = client.chat.completions.create(
        model=hermes_model(client), messages=messages, tools=[WEATHER], max_tokens=8
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens > 60  # the call and its result are in the prompt


def test_tools_need_a_known_call_format():
    srv = Server(["--kv-cache-memory", "0.5"])  # the default model: plain ChatML, no tools
    try:
        client = srv.client()
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=hermes_model(client), messages=ASK, tools=[WEATHER], max_tokens=4
            )
        assert "--tool-call-parser" in info.value.message
        # tool_choice none shows the tools and reads the reply as text
        reply = client.chat.completions.create(
            model=hermes_model(client), messages=ASK, tools=[WEATHER], tool_choice="none",
            max_tokens=4,
        )  # fmt: skip
        assert reply.choices[0].message.tool_calls is None
    finally:
        srv.stop()
