"""Structured outputs on the default model: every answer under a JSON schema, a regex or a
choice is valid; a constraint that allows what the model says anyway changes nothing; the
unconstrained rows of a mixed batch are untouched; bad constraints are refused by name."""

from __future__ import annotations

import re

import jsonschema
import pytest

from pagecli import LLM, SamplingParams
from pagecli.engine.llm_engine import GrammarRejected
from pagecli.sampling_params import StructuredOutputs
from tests.sizes import size

NUM_PROMPTS = size(12, 50)

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "draft": {"type": "boolean"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}

TOPICS = [
    "a person", "a city", "a book", "a car", "a fruit", "a song", "a film", "a dog",
    "a planet", "a recipe",
]  # fmt: skip


def prompts(kind: str) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": f"Answer in JSON ({kind}) about {TOPICS[i % len(TOPICS)]}, example {i}.",
            }
        ]
        for i in range(NUM_PROMPTS)
    ]


def mixed_params(structured: dict, max_tokens: int = 400) -> list[SamplingParams]:
    """Half greedy, half seeded sampling: both paths through the mask."""
    return [
        SamplingParams(temperature=0, max_tokens=max_tokens, structured=structured)
        if i % 2 == 0
        else SamplingParams(temperature=0.7, seed=i, max_tokens=max_tokens, structured=structured)
        for i in range(NUM_PROMPTS)
    ]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", num_kv_blocks=2048)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_under_a_schema_is_valid(llm, name):
    import json

    schema = SCHEMAS[name]
    outs = llm.generate(prompts(name), mixed_params({"json_schema": schema}))
    for out in outs:
        assert out.error is None
        assert out.outputs[0].finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    llm.engine.check_invariants()


def test_json_object_mode_gives_objects(llm):
    import json

    chats = [
        [{"role": "user", "content": f"Give me a JSON object describing person number {i}."}]
        for i in range(8)
    ]
    compact = {"json_object": True, "whitespace": "compact"}
    params = SamplingParams(temperature=0, max_tokens=200, structured=compact)
    outs = llm.generate(chats, params)
    # any object: a small model may repeat a key until max_tokens (the grammar allows it), so
    # only the answers that ended are parsed; every one opens an object
    ended = [o for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(ended) >= 2
    assert all(o.text.startswith('{"') and "\n" not in o.text for o in outs)
    for out in ended:
        assert isinstance(json.loads(out.text), dict)


def test_every_answer_under_a_regex_and_a_choice_is_valid(llm):
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9])?"
    outs = llm.generate(prompts("regex"), mixed_params({"regex": regex}))
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, out.text), out.text
    choices = ["yes", "no", "not sure", "yes, but later"]
    outs = llm.generate(prompts("choice"), mixed_params({"choice": choices}))
    assert {o.text for o in outs} <= set(choices)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_a_grammar_that_allows_the_answer_changes_nothing(llm):
    """Greedy output under a constraint that admits what the model says anyway is token for
    token the unconstrained output."""
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Say hello to Bob."}],
        [{"role": "user", "content": "Name three colors."}],
    ]
    free = llm.generate(chats, SamplingParams(temperature=0, max_tokens=40))
    for chat, out in zip(chats, free):
        assert out.outputs[0].finish_reason == "stop"  # EOS: a complete answer
        text = out.text
        # a choice holding the answer: the grammar completes exactly where the model's EOS
        # came, so the ids are the same but for that EOS
        choice = SamplingParams(
            temperature=0, max_tokens=40, structured={"choice": [text, text + " Not this."]}
        )
        constrained = llm.generate(chat, choice)[0]
        assert constrained.text == text
        assert out.token_ids[: len(constrained.token_ids)] == constrained.token_ids
        assert len(constrained.token_ids) >= len(out.token_ids) - 1
        # a regex over every character the answer uses, of any length: EOS included
        chars = "".join(sorted(set(text)))
        regex = "[" + "".join("\\" + c if c in "\\]^-[" else c for c in chars) + "]+"
        same = llm.generate(
            chat, SamplingParams(temperature=0, max_tokens=40, structured={"regex": regex})
        )[0]
        assert same.token_ids == out.token_ids
        assert same.text == text


def test_unconstrained_rows_of_a_mixed_batch_equal_their_output_alone(llm):
    chats = prompts("mixed")[:12]
    free = SamplingParams(temperature=0, max_tokens=24)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=24)
    alone = llm.generate(chats, [free if i % 4 else sampled for i in range(12)])
    schema = SCHEMAS["enum"]
    mixed_params_ = []
    for i in range(12):
        base = free if i % 4 else sampled
        mixed_params_.append(base)
        mixed_params_.append(
            SamplingParams(temperature=0, max_tokens=80, structured={"json_schema": schema})
        )
    mixed_chats = [c for chat in chats for c in (chat, chat)]
    together = llm.generate(mixed_chats, mixed_params_)
    import json

    for i in range(12):
        assert together[2 * i].token_ids == alone[i].token_ids
        jsonschema.validate(json.loads(together[2 * i + 1].text), schema)


def test_parallel_samples_each_follow_the_grammar(llm):
    regex = r"(cat|dog|bird)( and (cat|dog|bird)){0,2}"
    out = llm.generate(
        prompts("n")[0],
        SamplingParams(n=6, temperature=1.2, seed=11, max_tokens=30, structured={"regex": regex}),
    )[0]
    assert len(out.outputs) == 6
    for c in out.outputs:
        assert re.fullmatch(regex, c.text), c.text
    assert len({c.text for c in out.outputs}) > 1  # the forks' matchers are their own


def test_preemption_keeps_the_grammar_state():
    """With a KV cache too small for the batch, sequences are preempted and recomputed; the
    answers equal those of a roomy cache."""
    schema = SCHEMAS["bounded_numbers"]
    params = SamplingParams(temperature=0, max_tokens=60, structured={"json_schema": schema})
    chats = prompts("preempt")[:8]
    roomy = LLM(None, dtype="float32", block_size=4, num_kv_blocks=1024).generate(chats, params)
    small = LLM(None, dtype="float32", block_size=4, num_kv_blocks=60, max_num_batched_tokens=64)
    tight = small.generate(chats, params)
    assert small.engine.stats().preemptions_recompute > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]


def test_logprobs_are_the_models_own_under_a_grammar(llm):
    chat = prompts("lp")[0]
    free = llm.generate(chat, SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    first = free.outputs[0].logprobs[0]
    forced = llm.generate(
        chat,
        SamplingParams(temperature=0, max_tokens=4, logprobs=5, structured={"choice": ["zzz"]}),
    )[0]
    entry = forced.outputs[0].logprobs[0]
    assert forced.text == "zzz"
    assert entry.top == first.top  # the alternatives the mask forbade are still reported
    assert entry.token_id != first.token_id and entry.logprob < first.logprob


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json_schema": {"not": {"type": "string"}}}, "not"),
        ({"json_schema": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ],
)
def test_bad_constraints_are_refused_by_name(llm, spec, words):
    with pytest.raises(GrammarRejected, match=re.escape(words)):
        llm.engine.compile_grammar(StructuredOutputs(**spec))
    out = llm.generate(prompts("bad")[0], SamplingParams(max_tokens=4, structured=spec))[0]
    assert out.error and words in out.error and not out.outputs  # never run unconstrained


def test_a_slow_compile_is_refused_within_its_limit(llm):
    import time

    big = {
        "type": "object",
        "properties": {
            f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}@[a-z]+"} for i in range(8000)
        },
    }
    start = time.perf_counter()
    with pytest.raises(GrammarRejected, match="did not compile within 0.05 s"):
        llm.engine.compile_grammar(StructuredOutputs(json_schema=big), timeout_s=0.05)
    assert time.perf_counter() - start < 0.05 + 1.0
    # the engine goes on serving
    out = llm.generate(prompts("after")[0], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3


def test_gbnf_grammars_are_accepted(llm):
    gbnf = 'root ::= "The answer is " [0-9] [0-9]? "."'
    out = llm.generate(
        prompts("gbnf")[0],
        SamplingParams(temperature=0, max_tokens=20, structured={"grammar": gbnf}),
    )[0]
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.", out.text), out.text
