"""The speculative policy (engine/spec_decode/proposer.py) on simulated sequences whose
drafts are always accepted: where a step with drafts costs less than the tokens it emits,
nearly every step drafts; where it costs more (a draft model as dear as the target), drafts
stop once the costs say so, probes included, however well they would be accepted; where
drafts would pay only at a better acceptance than seen, they back off to a probe in
MAX_COOLDOWN_STEPS steps (prompt lookup's, whose probes cost only their rows, in
NGRAM_MAX_COOLDOWN_STEPS for each decoding sequence). A batch's drafts are weighed by the
cost of the batch's rows, not by what one sequence alone would pay. Prompt lookup weighs
each draft by the rate its kind of draft holds at."""

from __future__ import annotations

import pytest

from pagecli.config import SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch, ScheduledSeq
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.engine.spec_decode.proposer import (
    MAX_COOLDOWN_STEPS,
    NGRAM_MAX_COOLDOWN_STEPS,
    NgramProposer,
    Proposer,
    VerifyCost,
    token_kind,
)
from pagecli.sampling_params import SamplingParams


class Always(Proposer):
    """Drafts that the target always accepts: the token ids 7, 7, 7..."""

    def drafts(self, seq, k):
        return [7] * k


def running(count: int) -> list[Sequence]:
    """`count` running sequences, each decoding (one token left to compute)."""
    seqs = []
    for i in range(count):
        seq = Sequence(i, f"r{i}", [1, 2, 3], 3, SamplingParams(), max_tokens=10**6)
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 2
        seqs.append(seq)
    return seqs


def batch_steps(proposer: Proposer, seqs: list[Sequence], step_cost, steps: int) -> tuple[int, int]:
    """Run `steps` steps of `seqs` together (step_cost(rows) is a step's seconds); the draft
    rows they checked, and the steps that checked any."""
    drafted = drafting = 0
    for _ in range(steps):
        proposer.propose(seqs)
        items, samples = [], []
        for seq in seqs:
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            items.append(ScheduledSeq(seq, 1 + len(drafts), drafts))
            samples.append(SampledTokens([7] * (len(drafts) + 1), num_accepted=len(drafts)))
            drafted += len(drafts)
        drafting += any(item.draft_token_ids for item in items)
        rows = sum(item.num_new_tokens for item in items)
        proposer.observe(ScheduledBatch(decodes=items), samples, step_cost(rows))
        for seq, sampled in zip(seqs, samples):
            seq.token_ids += sampled.token_ids
            seq.num_computed_tokens = seq.num_tokens - 1
    return drafted, drafting


def simulate(step_cost, steps: int = 300) -> int:
    """Steps (of `steps`) in which one sequence checked drafts."""
    proposer = Always(SpeculativeConfig(num_speculative_tokens=4))
    return batch_steps(proposer, running(1), step_cost, steps)[1]


def test_drafts_that_pay_run_nearly_every_step():
    assert simulate(lambda rows: 1.0 + 0.1 * (rows - 1)) > 280


@pytest.mark.parametrize("per_row", [1.2, 2.0])
def test_drafts_that_cost_more_than_they_give_stop(per_row):
    """A row costs more than a one-row step (a draft model as dear as the target): no k
    pays, even at full acceptance. Once the costs say so, no probe runs either (a draft
    model's would first run the prompt through it): the first steps try, then none."""
    drafting = simulate(lambda rows: 1.0 + per_row * (rows - 1))
    assert drafting <= 3, drafting


def test_probes_resume_where_drafts_could_pay():
    """Drafts that pay at full acceptance but are not expected to at the acceptance seen
    back off and probe: in 300 steps at most one probe per back-off, and some."""
    proposer = Always(SpeculativeConfig(num_speculative_tokens=4))
    seq = running(1)[0]
    proposer.cost = VerifyCost({1: 1.0, 2: 1.6, 3: 2.2, 4: 2.8, 5: 3.4})
    probes = 0
    for _ in range(300):
        proposer.propose([seq])
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        probes += bool(drafts)
        seq.spec.acceptance = 0.5  # what its drafts keep showing
        seq.token_ids += [7]
        seq.num_computed_tokens = seq.num_tokens - 1
    assert 300 // MAX_COOLDOWN_STEPS <= probes <= 300 // MAX_COOLDOWN_STEPS + 6, probes


class RejectedDraftModel(Proposer):
    """The policy as a draft model has it, with drafts that the target always rejects."""

    def drafts(self, seq, k):
        return [7] * k


class RejectedLookup(NgramProposer):
    """Prompt lookup's policy with drafts that the target always rejects."""

    def drafts(self, seq, k):
        return [7] * k


@pytest.mark.parametrize(
    "cls, count, longest",
    [
        (RejectedDraftModel, 1, MAX_COOLDOWN_STEPS),
        (RejectedLookup, 1, NGRAM_MAX_COOLDOWN_STEPS),
        (RejectedLookup, 2, 2 * NGRAM_MAX_COOLDOWN_STEPS),
        (RejectedLookup, 4, MAX_COOLDOWN_STEPS),
    ],
)
def test_a_rejected_sequence_probes_once_per_longest_back_off(cls, count, longest):
    """Drafts that are always rejected back off to one probe of draft_min drafts in
    `longest` + 2 steps (the step that declines, the wait, the probe): a draft model's
    longest back-off is MAX_COOLDOWN_STEPS; prompt lookup's (its probe costs one verify row,
    nothing to make) NGRAM_MAX_COOLDOWN_STEPS for each decoding sequence, MAX_COOLDOWN_STEPS
    at most, so that a batch's probes add about as many rows as one sequence's. Once the
    acceptance seen has fallen (the first steps draft at the prior), each probe checks one
    draft, no more."""
    proposer = cls(SpeculativeConfig(num_speculative_tokens=4))
    proposer.cost = VerifyCost({r: 1.0 + 0.2 * (r - 1) for r in range(1, 30)})
    seqs = running(count)
    probes = []  # the steps in which the first sequence checked drafts
    for step in range(600):
        proposer.propose(seqs)
        items, samples = [], []
        for seq in seqs:
            drafts, seq.draft_token_ids = seq.draft_token_ids, []
            if drafts and seq is seqs[0]:
                probes.append(step)
            assert step < 40 or len(drafts) <= 1, (step, drafts)
            items.append(ScheduledSeq(seq, 1 + len(drafts), drafts))
            samples.append(SampledTokens([8]))
        rows = sum(item.num_new_tokens for item in items)
        proposer.observe(ScheduledBatch(decodes=items), samples, proposer.cost.estimate(rows))
        for seq in seqs:
            seq.token_ids += [8]
            seq.num_computed_tokens = seq.num_tokens - 1
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[-1] == longest + 2 and max(gaps) == longest + 2, gaps
    assert 600 // (longest + 2) <= len(probes) <= 600 // (longest + 2) + 8, len(probes)


def bound_by_arithmetic_past_4_rows(rows: int) -> float:
    """A machine that reads the weights once for up to 4 rows, then pays every row."""
    return max(1.0, rows / 4)


@pytest.mark.parametrize("alone_first", [0, 40])
def test_a_batch_whose_rows_fill_the_machine_gets_no_drafts(alone_first):
    """One sequence alone drafts (3 drafts are free); eight together already fill the
    machine, where drafts all accepted emit as many tokens per second as no drafts: only
    the first optimistic steps and the probes draft. `alone_first` steps of one sequence
    alone teach the policy the one-row curve first (drafting then, nearly every step)."""
    proposer = Always(SpeculativeConfig(num_speculative_tokens=4))
    seqs = running(8)
    if alone_first:
        alone = batch_steps(proposer, seqs[:1], bound_by_arithmetic_past_4_rows, alone_first)[0]
        assert alone > 3 * (alone_first - 2)
    drafted = batch_steps(proposer, seqs, bound_by_arithmetic_past_4_rows, 300)[0]
    # eight sequences' probes (one in MAX_COOLDOWN_STEPS steps once backed off) and the
    # drafts of a few steps before the costs of the batch's rows are measured
    assert drafted <= 8 * (300 // MAX_COOLDOWN_STEPS + 6) + 3 * 8 * 4, drafted


def test_a_batch_drafts_where_its_rows_cost_little():
    """Where the weights' bytes bound the step (a row costs a hundredth of it), eight
    sequences draft nearly all their drafts every step."""
    seqs = running(8)
    proposer = Always(SpeculativeConfig(num_speculative_tokens=4))
    drafted = batch_steps(proposer, seqs, lambda rows: 1.0 + 0.01 * rows, 100)[0]
    assert drafted > 0.9 * 8 * 4 * 100, drafted


def test_verify_cost_interpolates_and_extends_the_measured_rows():
    cost = VerifyCost()
    assert cost.estimate(3) is None and cost.ratio(3) == 1.0
    cost.observe(2, 2.0)
    assert cost.estimate(9) == 2.0  # one row count measured: flat, worth trying
    cost.observe(6, 4.0)
    assert cost.estimate(4) == 3.0  # between: linear
    assert cost.estimate(10) == 6.0  # past: the mean growth per row
    assert cost.estimate(1) == 1.5  # below: extended down, ...
    assert cost.ratio(6, 2) == 2.0
    steep = VerifyCost({2: 2.0, 6: 10.0})
    assert steep.estimate(1) == 1.0  # ... never under the smallest's cost per row


def test_token_kinds():
    assert [token_kind(t) for t in ["name", "_slots", "9", " seq", " _x"]] == (
        ["word", "word", "word", "spaced", "spaced"]
    )
    assert {token_kind(t) for t in ['",\n', " (", "(", " ", "\n    ", ""]} == {"other"}


class NamesThenPunctuation(NgramProposer):
    """Prompt lookup's policy with drafts that copy a name (two word pieces) and then the
    code's punctuation after it, where the target takes the name and not what follows (a
    JSON reply that lists names from code)."""

    def drafts(self, seq, k):
        seq.spec.classes = [("word", False)] * 2 + [("other", False)] * 2
        return [7, 7, 9, 9][:k]


def test_prompt_lookup_drafts_the_kinds_that_hold():
    """Each kind of draft has its own rate: the policy learns to draft the name's two pieces
    and stop before the punctuation, where one rate for all (a half) would keep trying
    more or settle for fewer."""
    proposer = NamesThenPunctuation(SpeculativeConfig(num_speculative_tokens=4))
    proposer.cost = VerifyCost({r: 1.0 + 0.2 * (r - 1) for r in range(1, 10)})
    seq = running(1)[0]
    counts = []
    for _ in range(100):
        proposer.propose([seq])
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        counts.append(len(drafts))
        accepted = min(len(drafts), 2)  # the name's pieces
        item = ScheduledSeq(seq, 1 + len(drafts), drafts)
        sampled = SampledTokens([7] * (accepted + 1), num_accepted=accepted)
        seconds = proposer.cost.estimate(1 + len(drafts))
        proposer.observe(ScheduledBatch(decodes=[item]), [sampled], seconds)
        seq.token_ids += sampled.token_ids
        seq.num_computed_tokens = seq.num_tokens - 1
    assert counts[-50:].count(2) >= 48, counts
    rates = seq.spec.rates
    # the punctuation's rate stays where its drafts stopped paying: no longer checked
    assert rates[("word", False)] > 0.99 and rates[("other", False)] < 0.5, rates
    assert proposer.draft_rates(seq, [7, 7, 9]) == [
        rates[("word", False)],
        rates[("word", False)],
        rates[("other", False)],
    ]


def test_prompt_lookup_stops_before_special_tokens():
    """A reply whose first token also ended the user's message (a closing code fence, 5
    here) matches that end, which the chat template's tail follows (END, a newline 6,
    START, the assistant's header 8, 6): no drafts, where the copy would be rejected. A
    copy that reaches a special token stops before it."""
    END, START = 100, 101
    config = SpeculativeConfig(num_speculative_tokens=7)
    prompt = [START, 7, 6, 5, 9, 2, 3, 4, 6, 5, END, 6, START, 8, 6]

    def drafts(proposer, reply):
        seq = Sequence(0, "r0", prompt + reply, len(prompt), SamplingParams(), max_tokens=99)
        seq.spec = proposer.new_state()
        return proposer.drafts(seq, 7), seq.spec.classes

    stops = NgramProposer(config, lambda token: "x", lambda token: token in (END, START))
    assert drafts(stops, [6, 5]) == ([], [])
    found, classes = drafts(stops, [5, 9])  # the fence's line, copied: 2, 3, 4, 6, 5, then END
    assert found == [2, 3, 4, 6, 5]
    assert [kind for kind, _ in classes] == ["word"] * 5
    plain = NgramProposer(config, lambda token: "x")
    assert drafts(plain, [6, 5])[0] == [END, 6, START, 8, 6, 6, 5]  # the template's tail
    assert drafts(plain, [5, 9])[0] == [2, 3, 4, 6, 5, END, 6]
