"""Speculative decoding from the command line: vLLM's --speculative-config and llama.cpp's
shorthands give generate the same records; chat's turn line shows the drafts' acceptance;
bad settings end in one line, exit 2, before any model loads."""

from __future__ import annotations

import pytest

from pagecli.cli.options import engine_config
from tests.cli.helpers import jsonl, no_traceback, records, run
from tests.sizes import FULL

ECHO = (
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog, "
    "and the lazy dog sleeps."
)
ARGS = ["--temperature", "0", "--max-tokens", "48", "--kv-cache-memory", "0.25"]


def test_generate_records_are_the_same_with_drafts():
    stdin = jsonl({"id": 1, "prompt": ECHO}, {"id": 2, "prompt": "Count from 1 to 20."})
    plain = run(["generate", *ARGS], stdin)
    assert plain.returncode == 0, plain.stderr
    variants = [["--draft-max", "6", "--draft-min", "2"]]  # the shorthands turn it on
    if FULL:
        variants += [
            ["--spec-type", "ngram"],
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        ]
    for flags in variants:
        spec = run(["generate", *ARGS, *flags], stdin)
        assert spec.returncode == 0 and spec.stderr == b"", spec.stderr
        assert [(r["text"], r["finish_reason"]) for r in records(spec.stdout)] == [
            (r["text"], r["finish_reason"]) for r in records(plain.stdout)
        ]


def test_chat_turn_line_shows_the_acceptance():
    done = run(["chat", *ARGS, "--spec-type", "ngram"], f"{ECHO}\n".encode())
    no_traceback(done.stderr)
    assert done.returncode == 0, done.stderr
    assert "accepted" in done.stderr.decode() and "tokens a step" in done.stderr.decode()


def test_the_shorthands_fold_into_the_config():
    """What each spelling turns into (the processes above run one of them end to end)."""

    def spec(**values):
        return engine_config(
            {"spec_type": None, "draft_max": None, "draft_min": None, "model_draft": None, **values}
        ).speculative_config

    assert spec() is None and spec(spec_type="none") is None
    assert spec(spec_type="ngram").num_speculative_tokens == 7
    both = spec(speculative_config='{"prompt_lookup_max": 3}', draft_max=7, draft_min=2)
    assert (both.num_speculative_tokens, both.draft_min, both.prompt_lookup_max) == (7, 2, 3)
    draft = spec(model_draft="small.gguf", draft_max=3)
    assert (draft.method, draft.model, draft.num_speculative_tokens) == (
        "draft_model",
        "small.gguf",
        3,
    )


@pytest.mark.parametrize(
    "flags, word",
    [
        (["--speculative-config", '{"method": "ngram", "k": 3}'], "unknown key 'k'"),
        (["-md", "draft.gguf"], "draft model: draft.gguf"),
        (["--spec-type", "ngram", "-md", "draft.gguf"], "pick one"),
        (["--speculative-config", "{bad"], "not JSON"),
        (["--draft-max", "0"], "num_speculative_tokens"),
        (["--spec-type", "eagle"], "--spec-type"),
        (["--spec-type", "none", "--draft-max", "4"], "--spec-type none"),
    ],
)
def test_bad_settings_are_one_line_exit_2(flags, word):
    done = run(["generate", *flags], jsonl({"prompt": "hi"}))
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 2 and done.stdout == b""
    assert len(lines) == 1 and word in lines[0], lines
