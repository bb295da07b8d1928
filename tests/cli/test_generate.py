"""`pagecli generate` end to end: one run of the real process over a mixed input checks the
schema, order, prompt forms, sampling fields, the OpenAI batch format and every bad line."""

from __future__ import annotations

import pytest

from tests.cli.helpers import FAST, jsonl, records, run

SYSTEM = "You are a pirate."
HI = [{"role": "user", "content": "Say hi"}]
OWN_SYSTEM = [{"role": "system", "content": "Be brief."}, *HI]


def chat_ids(model_dir, messages) -> list[int]:
    """The chat template applied by transformers itself, as the reference."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


# (input line, expected id, a word the error message must hold, or None for a good record)
def cases(model_dir):
    with_system = [{"role": "system", "content": SYSTEM}, *HI]
    return [
        ({"id": "plain", "prompt": "The capital of France is"}, "plain", None),
        ({"id": "stop", "prompt": "The capital of France is", "stop": ["."]}, "stop", None),
        ({"id": "chat", "messages": HI}, "chat", None),
        (
            {"id": "chat-ids", "prompt_token_ids": chat_ids(model_dir, with_system)},
            "chat-ids",
            None,
        ),
        ({"id": "own-system", "messages": OWN_SYSTEM}, "own-system", None),
        ({"id": 70, "prompt_token_ids": [504, 2988, 314]}, 70, None),
        ({"prompt": "No id here"}, 7, None),  # the default id is the line number
        (
            {"id": "n2", "prompt": "The weather is", "n": 2, "temperature": 1.0, "seed": 5},
            "n2",
            None,
        ),
        (
            {"id": "seed-a", "prompt": "Once upon a time", "temperature": 1.0, "seed": 123},
            "seed-a",
            None,
        ),
        (
            {"id": "seed-b", "prompt": "Once upon a time", "temperature": 1.0, "seed": 123},
            "seed-b",
            None,
        ),
        (
            {
                "custom_id": "oa-chat",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "any",
                    "messages": HI,
                    "max_completion_tokens": 5,
                    "temperature": 0,
                },
            },
            "oa-chat",
            None,
        ),
        (
            {
                "custom_id": "oa-cmpl",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"prompt": "The capital of France is", "max_tokens": 6},
            },
            "oa-cmpl",
            None,
        ),
        ("not json", 13, "JSON"),
        ("[1, 2]", 14, "object"),
        ({"id": "wrong-type", "prompt": 5}, "wrong-type", "prompt must be a string"),
        ({"id": "no-prompt", "max_tokens": 3}, "no-prompt", "exactly one of"),
        ({"id": "two", "prompt": "a", "messages": HI}, "two", "prompt and messages"),
        ({"id": "unknown", "prompt": "a", "colour": "red"}, "unknown", "colour"),
        ({"id": "bad-temp", "prompt": "a", "temperature": -1}, "bad-temp", "temperature"),
        ({"id": "too-long", "prompt": "word " * 300}, "too-long", "max_model_len"),
        ({"id": "plain", "prompt": "again"}, "plain", "duplicate id"),
        (b'{"id": "latin1", "prompt": "caf\xe9"}', 22, "UTF-8"),
        (
            {"custom_id": "oa-bad", "method": "POST", "url": "/v1/embeddings", "body": {}},
            "oa-bad",
            "url",
        ),
        ("", None, None),  # a blank line is skipped, and still counts as a line
        ({"id": "last", "prompt": "Hello"}, "last", None),
    ]


@pytest.fixture(scope="module")
def main_run(default_model_dir):
    table = cases(default_model_dir)
    proc = run(
        ["generate", *FAST, "--max-model-len", "128", "--system", SYSTEM],
        jsonl(*(c[0] for c in table)),
    )
    expected = [(line, rid, word) for line, (_, rid, word) in enumerate(table, 1) if rid]
    return proc, records(proc.stdout), expected


def by_id(out):
    """The first record of each id (a later duplicate is an error record)."""
    found = {}
    for r in out:
        found.setdefault(r.get("custom_id", r.get("id")), r)
    return found


def test_exit_code_and_streams(main_run):
    proc, out, expected = main_run
    assert proc.returncode == 0
    assert proc.stderr == b""  # no progress (not a terminal), no warnings
    assert len(out) == len(expected)


def test_one_record_per_line_in_input_order(main_run):
    _, out, expected = main_run
    assert [r.get("custom_id", r.get("id")) for r in out] == [rid for _, rid, _ in expected]


def test_schema(main_run):
    _, out, _ = main_run
    for r in out:
        if "custom_id" in r:
            continue
        keys = {"id", "text", "token_ids", "finish_reason", "usage", "error"}
        assert set(r) == keys | ({"choices"} if r["id"] == "n2" else set())
        assert set(r["usage"]) == {"prompt_tokens", "completion_tokens", "cached_tokens"}
        assert r["finish_reason"] in ("stop", "length", "error")
        if r["error"] is None and "choices" not in r:
            assert r["usage"]["completion_tokens"] == len(r["token_ids"]) > 0
            assert r["usage"]["prompt_tokens"] > 0


def test_prompt_forms(main_run, default_model_dir):
    _, out, _ = main_run
    rec = by_id(out)
    # messages get the model's chat template (and --system): same as the templated token ids
    assert rec["chat"]["token_ids"] == rec["chat-ids"]["token_ids"]
    assert rec["chat"]["text"] == rec["chat-ids"]["text"]
    assert rec["chat"]["usage"]["prompt_tokens"] == len(
        chat_ids(default_model_dir, [{"role": "system", "content": SYSTEM}, *HI])
    )
    # a conversation with its own system message keeps it
    assert rec["own-system"]["usage"]["prompt_tokens"] == len(
        chat_ids(default_model_dir, OWN_SYSTEM)
    )
    assert rec[70]["usage"]["prompt_tokens"] == 3
    assert rec[7]["error"] is None
    assert rec["plain"]["usage"]["completion_tokens"] == 6  # --max-tokens
    assert rec["plain"]["finish_reason"] == "length"


def test_stop_string(main_run):
    _, out, _ = main_run
    rec = by_id(out)
    assert rec["stop"]["finish_reason"] == "stop"
    assert "." not in rec["stop"]["text"]
    assert rec["plain"]["text"].startswith(rec["stop"]["text"] + ".")


def test_n_samples(main_run):
    _, out, _ = main_run
    r = by_id(out)["n2"]
    assert [c["index"] for c in r["choices"]] == [0, 1]
    first = r["choices"][0]
    assert (r["text"], r["token_ids"], r["finish_reason"]) == (
        first["text"],
        first["token_ids"],
        first["finish_reason"],
    )
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])


def test_same_seed_same_text(main_run):
    _, out, _ = main_run
    rec = by_id(out)
    assert rec["seed-a"]["token_ids"] == rec["seed-b"]["token_ids"]
    assert rec["seed-a"]["text"] == rec["seed-b"]["text"]


def test_openai_batch_lines(main_run):
    _, out, _ = main_run
    rec = by_id(out)
    chat, cmpl = rec["oa-chat"], rec["oa-cmpl"]
    for r in (chat, cmpl):
        assert set(r) == {"id", "custom_id", "response", "error"}
        assert r["id"].startswith("batch_req_") and r["error"] is None
        assert r["response"]["status_code"] == 200 and r["response"]["request_id"]
        body = r["response"]["body"]
        assert {"id", "object", "created", "model", "choices", "usage"} <= set(body)
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    chat_body, cmpl_body = chat["response"]["body"], cmpl["response"]["body"]
    assert chat_body["object"] == "chat.completion"
    message = chat_body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert chat_body["usage"]["completion_tokens"] == 5  # max_completion_tokens
    assert rec["chat"]["text"].startswith(message["content"])  # same prompt, greedy
    assert cmpl_body["object"] == "text_completion"
    assert cmpl_body["choices"][0]["text"] == rec["plain"]["text"]
    assert cmpl_body["choices"][0]["finish_reason"] == "length"


def test_bad_lines_are_error_records(main_run):
    _, out, expected = main_run
    for r, (line, _, word) in zip(out, expected):
        if word is None:
            assert r["error"] is None, r
            continue
        if "custom_id" in r:  # an OpenAI line is answered in the batch error format
            assert r["response"] is None and r["error"]["code"]
        else:
            assert r["finish_reason"] == "error" and r["text"] == "" and r["token_ids"] == []
        assert r["error"]["line"] == line
        assert word in r["error"]["message"], r["error"]
