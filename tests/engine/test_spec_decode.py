"""Speculative decoding (n-gram) gives the tokens decoding without it gives: greedy and
seeded sampling, through chunked prefills, prefix hits, preemption (recompute and swap),
logprobs, stop strings and ids, EOS and max_tokens inside a run of drafts, on the default
model's own (quantized) path. Each test also checks that drafts were checked and accepted,
so a proposer that never fires cannot pass it."""

from __future__ import annotations

import pytest

from pagecli import LLM, SamplingParams
from pagecli.engine.sequence import Sequence
from pagecli.engine.spec_decode.proposer import NgramProposer, Proposer
from pagecli_kernels.settings import kernel_settings
from tests.sizes import size

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# Replies that repeat their prompt (the case prompt lookup is for) and ones that do not.
PROMPTS = [
    chat("Repeat this sentence three times: The quick brown fox jumps over the lazy dog."),
    chat(
        "Rename the variable x to count in this function and show the whole function:\n\n"
        "def step(x):\n    x = x + 1\n    if x > 10:\n        x = 0\n    return x * x\n"
    ),
    chat("List the numbers from 1 to 30, separated by commas."),
    chat("Write a short poem about the sea."),
    chat("Quote the second line of this text.\nRoses are red.\nViolets are blue.\nSugar."),
]
# raw text that the model goes on repeating for a while, in bfloat16 too
REPEATING = "def area(width, height):\n    return width * height\n\n\n" * 2 + "def area("


def tight_engine(mode: str) -> dict:
    """Engine settings under which a few prompts preempt each other (`mode`: recompute or
    swap) and prefill in chunks of 32 tokens."""
    engine = dict(block_size=4, num_kv_blocks=32, max_num_batched_tokens=32, preemption_mode=mode)
    if mode == "swap":
        engine["swap_space"] = 0.05
    return engine


def run(prompts, params, spec: bool | dict, **engine):
    """`spec`: SPEC (True), another speculative config, or none (False)."""
    config = (SPEC if spec is True else spec) or None
    llm = LLM(None, speculative_config=config, **engine)
    outputs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert stats.blocks_in_use == 0
    return outputs, stats


def same(off, on) -> None:
    for a, b in zip(off, on):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert [(o.finish_reason, o.stop_reason) for o in a.outputs] == [
            (o.finish_reason, o.stop_reason) for o in b.outputs
        ]


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_greedy_identity(max_num_seqs):
    params = SamplingParams(temperature=0, max_tokens=size(48, 128))
    off, _ = run(PROMPTS, params, False, max_num_seqs=max_num_seqs)
    on, stats = run(PROMPTS, params, True, max_num_seqs=max_num_seqs)
    same(off, on)
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0
    # fewer steps than tokens: accepted drafts came out several to a step
    assert stats.num_steps < sum(len(o.token_ids) for o in on)


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_logprobs_have_the_bits_of_decoding_without_drafts(max_num_seqs):
    """Bits first: a verify row's logits are bit for bit those of the same row decoded
    alone (the linear layers' fused kernels and attention's splits do not depend on the
    rows beside it), so every logprob, top-5 included, is equal, not only every token."""
    params = SamplingParams(temperature=0, max_tokens=size(40, 96), logprobs=5)
    off, _ = run(PROMPTS, params, False, max_num_seqs=max_num_seqs)
    on, stats = run(PROMPTS, params, True, max_num_seqs=max_num_seqs)
    same(off, on)
    for a, b in zip(off, on):
        want, got = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [(lp.logprob, lp.top) for lp in got] == [(lp.logprob, lp.top) for lp in want]
    assert stats.spec_accepted_tokens > 0


@pytest.mark.parametrize(("max_num_seqs", "gemm"), [(1, "auto"), (8, "auto"), (8, "off")])
def test_bfloat16_logprobs_have_the_bits_of_decoding_without_drafts(
    max_num_seqs, gemm, monkeypatch
):
    """The same in bfloat16 (the default model's weights as bfloat16, `BF16Linear`): a step
    of up to 8 rows, or a step with drafts of any size, takes the row kernels, whatever
    multiplies larger bfloat16 batches ("off": torch's GEMM, whose rows' bits depend on their
    batch). Every candidate drafts all it can in every step, so that most steps check drafts."""
    monkeypatch.setattr(
        Proposer, "allocate", lambda self, candidates, rows, tokens: [len(c) for c in candidates]
    )
    params = SamplingParams(temperature=0, max_tokens=size(24, 64), logprobs=5)
    engine = dict(dtype="bfloat16", quantization="none", max_num_seqs=max_num_seqs)
    prompts = [*PROMPTS, REPEATING]
    with kernel_settings(bf16_gemm=gemm):
        off, _ = run(prompts, params, False, **engine)
        on, stats = run(prompts, params, True, **engine)
    same(off, on)
    for a, b in zip(off, on):
        want, got = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [(lp.logprob, lp.top) for lp in got] == [(lp.logprob, lp.top) for lp in want]
    assert stats.spec_draft_tokens > 40 and stats.spec_accepted_tokens > 12


def test_verify_steps_of_more_than_8_rows_keep_the_bits(monkeypatch):
    """Up to 15 drafts, every candidate drafting all it can: steps of 9-16 rows, whose linear
    layers take their rows in parts (csrc/quant_linear_cpu.c: many_parts on Intel's AVX-512,
    the rows kernel elsewhere), each row with the bits it has alone: every logprob equal."""
    monkeypatch.setattr(
        Proposer, "allocate", lambda self, candidates, rows, tokens: [len(c) for c in candidates]
    )
    params = SamplingParams(temperature=0, max_tokens=size(48, 96), logprobs=5)
    prompts = [REPEATING, PROMPTS[2]]
    off, _ = run(prompts, params, False, max_num_seqs=1)
    on, stats = run(prompts, params, {**SPEC, "num_speculative_tokens": 15}, max_num_seqs=1)
    same(off, on)
    for a, b in zip(off, on):
        want, got = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [(lp.logprob, lp.top) for lp in got] == [(lp.logprob, lp.top) for lp in want]
    # some step checked more than 8 drafts, and some of those past the 8th held
    per_position = stats.spec_accepted_per_position
    assert len(per_position) > 8 and sum(per_position[8:]) > 0, per_position


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identity_through_chunks_prefix_hits_preemption_and_logprobs(mode):
    """A small cache (preemption), a small token budget (chunked prefills), the same prompt
    twice (prefix hits), logprobs=5: the same tokens, and logprobs for each. (Here steps mix
    prefill chunks with decodes, and which rows share a step differs with drafts on: a decode
    beside a chunk of more than 8 rows takes the panels, another order of sums, so only the
    tokens are compared.)"""
    prompts = PROMPTS[:3] + PROMPTS[:1]
    params = SamplingParams(temperature=0, max_tokens=size(40, 96), logprobs=5)
    engine = tight_engine(mode)
    off, _ = run(prompts, params, False, **engine)
    on, stats = run(prompts, params, True, **engine)
    same(off, on)
    for out in on:
        assert [lp.token_id for lp in out.outputs[0].logprobs] == out.outputs[0].token_ids
        assert [len(lp.top) for lp in out.outputs[0].logprobs] == [5] * len(out.token_ids)
    assert stats.spec_accepted_tokens > 0
    assert stats.chunked_prefills > 0 and stats.prefix_hit_tokens > 0
    assert stats.preemptions_swap > 0 if mode == "swap" else stats.preemptions_recompute > 0


def test_stops_eos_and_max_tokens_inside_drafts():
    """Stop strings, stop ids, EOS and max_tokens cut a run of accepted drafts at the token
    where decoding one token at a time stops."""
    prompt = PROMPTS[1]  # the reply copies the function: runs of accepted drafts
    full, _ = run([prompt], SamplingParams(temperature=0, max_tokens=64), False)
    ids, text = full[0].token_ids, full[0].text
    assert "x > 10" in text and "x = 0" in text  # what the cases stop at
    cases = [
        SamplingParams(temperature=0, max_tokens=64, stop=["x > 10"]),
        SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[ids[12]]),
        SamplingParams(temperature=0, max_tokens=64, stop=["zzz", "x = 0"]),
        SamplingParams(temperature=0, max_tokens=23),  # ends inside a run of drafts
        SamplingParams(temperature=0, max_tokens=200),  # to EOS
    ]
    accepted = 0
    for params in cases:
        off, _ = run([prompt], params, False)
        on, stats = run([prompt], params, True)
        same(off, on)
        accepted += stats.spec_accepted_tokens
    assert accepted > 0


def test_seeded_sampling_identity():
    """temperature, top-p, a presence penalty and a seed, n = 3: each sample's generator
    draws once per emitted token, in order, with or without drafts."""
    params = SamplingParams(
        n=3, temperature=0.8, top_p=0.9, presence_penalty=0.3, seed=11, max_tokens=size(40, 96)
    )
    off, _ = run(PROMPTS[:3], params, False)
    on, stats = run(PROMPTS[:3], params, True)
    same(off, on)
    assert stats.spec_drafts > 0


@pytest.mark.parametrize("seeded", [False, True])
def test_structured_outputs_stay_valid_and_identical(seeded):
    """Each draft row is masked with the grammar's state after the drafts before it."""
    import json

    from pagecli.sampling_params import StructuredOutputs

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,  # else a sampled reply may run on past max_tokens
    }
    params = SamplingParams(
        temperature=0.8 if seeded else 0,
        seed=7 if seeded else None,
        max_tokens=60,
        structured=StructuredOutputs(json_schema=schema),
    )
    prompts = [chat("Describe a person as JSON with a name and an age."), PROMPTS[0]]
    off, _ = run(prompts, params, False)
    on, stats = run(prompts, params, True)
    same(off, on)
    for out in on:
        json.loads(out.text)
    # the grammar's forced tokens (the keys, their quotes and colons) went as drafts
    assert stats.spec_drafts > 0 and stats.spec_accepted_tokens > 0


def test_prompt_lookup_does_not_copy_the_chat_template():
    """A reply whose first token ends the user's message too (a closing code fence) matches
    that end, which the chat template's tail follows: the engine's proposer knows the
    tokenizer's special tokens and drafts none of them, where a proposer without that
    knowledge copies the template's end of turn."""
    llm = LLM(None, speculative_config=SPEC)
    tokenizer, proposer = llm.engine.tokenizer, llm.engine.proposer
    assert proposer.special(tokenizer.eos_token_id)
    (fence,) = tokenizer.encode("```", add_special_tokens=False)
    assert not proposer.special(fence)
    prompt = tokenizer.encode_chat(chat("Fix this:\n```\nx = 1\n```"))
    assert fence in prompt[-8:]
    seq = Sequence(0, "r0", prompt + [fence], len(prompt), SamplingParams(), max_tokens=64)
    seq.spec = proposer.new_state()
    assert proposer.drafts(seq, 4) == []
    plain = NgramProposer(llm.engine.config.speculative_config, proposer.token_text)
    seq.spec = plain.new_state()
    drafts = plain.drafts(seq, 4)
    assert drafts and proposer.special(drafts[0]), drafts
