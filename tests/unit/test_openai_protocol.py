"""The one OpenAI mapping (pagecli/openai/protocol.py): request fields to SamplingParams and back,
and the batch lines of `pagecli generate` validated by the server's own models."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagecli.batch.jsonl import BadLine, Job, parse_line
from pagecli.openai.protocol import (
    BatchLine,
    ChatCompletionRequest,
    CompletionRequest,
    batch_request,
    first_error,
    sampling_body,
)
from pagecli.sampling_params import SamplingParams, StructuredOutputs

HI = [{"role": "user", "content": "hi"}]
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

constraints = st.none() | st.sampled_from(
    [
        StructuredOutputs(json_object=True),
        StructuredOutputs(json_schema={"type": "object"}),
        StructuredOutputs(json_schema={"type": "object"}, whitespace="compact"),
        StructuredOutputs(regex="[0-9]{3}"),
        StructuredOutputs(choice=["yes", "no"]),
        StructuredOutputs(grammar='start: "a"'),
    ]
)
sampling = st.builds(
    SamplingParams,
    n=st.integers(1, 4),
    max_tokens=st.integers(1, 500),
    temperature=st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    top_k=st.sampled_from([0, 1, 40]),
    min_p=st.sampled_from([0.0, 0.05]),
    seed=st.none() | st.integers(0, 2**31),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2),
    stop_token_ids=st.lists(st.integers(0, 50000), max_size=2),
    ignore_eos=st.booleans(),
    repetition_penalty=st.sampled_from([1.0, 1.1]),
    presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
    frequency_penalty=st.sampled_from([0.0, 0.3]),
    skip_special_tokens=st.booleans(),
    logprobs=st.none() | st.integers(0, 5),
    structured=constraints,
)


@SETTINGS
@given(sampling)
def test_a_chat_request_written_from_params_reads_back_as_them(params):
    """The remote backend's requests (sampling_body) and the server's reading of a request
    (sampling_params) are one mapping: there and back is the identity."""
    request = ChatCompletionRequest.model_validate({"messages": HI, **sampling_body(params, True)})
    assert request.unsupported_field() is None and request.unknown_fields() == []
    assert request.sampling_params() == params


@SETTINGS
@given(sampling)
def test_a_completion_request_written_from_params_reads_back_as_them(params):
    body = {"prompt": "x", **sampling_body(params, False)}
    assert CompletionRequest.model_validate(body).sampling_params() == params


def test_endpoint_defaults_and_a_base_that_replaces_them():
    chat = ChatCompletionRequest.model_validate({"messages": HI})
    assert chat.sampling_params() == SamplingParams(max_tokens=None)
    assert CompletionRequest.model_validate({"prompt": "x"}).sampling_params().max_tokens == 16
    base = {"max_tokens": 8, "temperature": 0.0, "structured": StructuredOutputs(regex="a")}
    assert chat.sampling_params(base) == SamplingParams(**base)
    # only the fields a request sets replace the base; a constraint field replaces it even
    # when it asks for none
    set_some = {"messages": HI, "max_completion_tokens": 3, "response_format": {"type": "text"}}
    got = ChatCompletionRequest.model_validate(set_some).sampling_params(base)
    assert got == SamplingParams(max_tokens=3, temperature=0.0, structured=None)


def test_first_error_names_the_field():
    with pytest.raises(Exception) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 5}]})
    message, field = first_error(info.value.errors(), "body.")
    assert field == "body.messages[0].content" and message.startswith(field + ": ")
    assert first_error([]) == ("invalid request body", None)


def batch(url: str, body: dict, **line) -> Job | BadLine:
    import json

    obj = {"custom_id": "c", "method": "POST", "url": url, "body": body, **line}
    return parse_line(json.dumps(obj).encode(), 4, {"max_tokens": 8, "temperature": 0.0})


def test_batch_lines_use_the_servers_mapping_over_the_cli_defaults():
    body = {"messages": HI, "temperature": 0.5, "stop": "x", "model": "any", "user": "u"}
    job = batch("/v1/chat/completions", body)
    assert isinstance(job, Job) and job.api == "chat"
    server = ChatCompletionRequest.model_validate(body).sampling_params({"max_tokens": 8})
    assert job.params == server == SamplingParams(max_tokens=8, temperature=0.5, stop=["x"])
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert batch("/v1/chat/completions", {"messages": parts}).prompt == [
        {"role": "user", "content": "ab"}
    ]
    ids = batch("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
    assert ids.prompt == {"prompt_token_ids": [1, 2, 3]} and ids.params.max_tokens == 2


@pytest.mark.parametrize(
    ("url", "body", "words"),
    [
        ("/v1/chat/completions", {}, "body.messages: Field required"),
        ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}, "body.temperature"),
        ("/v1/chat/completions", {"messages": HI, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": HI, "colour": 1}, "unknown field body.colour"),
        ("/v1/chat/completions", {"messages": HI, "stream": True}, "body.stream is not supported"),
        ("/v1/chat/completions", {"messages": HI, "logprobs": True}, "body.logprobs"),
        ("/v1/chat/completions", {"messages": HI, "tools": []}, "body.tools"),
        ("/v1/chat/completions", {"messages": HI, "logit_bias": {"1": 2}}, "body.logit_bias"),
        ("/v1/completions", {"prompt": "x", "tools": []}, "body.tools is not supported"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "body.echo is not supported"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt per batch line"),
        ("/v1/completions", {"prompt": []}, "body.prompt must not be empty"),
        ("/v1/completions", {"prompt": "x", "response_format": "json"}, "response_format"),
    ],
)
def test_bad_batch_bodies_name_the_field(url, body, words):
    bad = batch(url, body)
    assert isinstance(bad, BadLine) and bad.id == "c" and bad.line == 4, bad
    assert words in bad.message and "\n" not in bad.message, bad.message


def test_batch_line_shape():
    assert BatchLine.model_validate(
        {"custom_id": "c", "url": "/v1/completions", "body": {}}
    ).method == ("POST")
    with pytest.raises(ValueError):
        batch_request("/v1/completions", {"prompt": "x", "stream": True})
