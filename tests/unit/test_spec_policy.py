"""The speculative policy (engine/spec_decode/proposer.py) on a simulated sequence whose
drafts are always accepted: where a step with drafts costs less than the tokens it emits,
nearly every step drafts; where it costs more (a draft model as dear as the target), the
probes back off to one in MAX_COOLDOWN_STEPS steps, however well they are accepted (and a
draft model, whose probes are dear, stops probing)."""

from __future__ import annotations

import pytest

from pagecli.config import SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens, ScheduledBatch, ScheduledSeq
from pagecli.engine.sequence import Sequence, SequenceStatus
from pagecli.engine.spec_decode.proposer import MAX_COOLDOWN_STEPS, Proposer
from pagecli.sampling_params import SamplingParams


class Always(Proposer):
    """Drafts that the target always accepts: the token ids 7, 7, 7..."""

    def drafts(self, seq, k):
        return [7] * k


def simulate(step_cost, steps: int = 300, dear_probes: bool = False) -> int:
    """Steps (of `steps`) that checked drafts; step_cost(rows) is a step's seconds."""
    proposer = Always(SpeculativeConfig(num_speculative_tokens=4))
    proposer.dear_probes = dear_probes
    seq = Sequence(0, "r", [1, 2, 3], 3, SamplingParams(), max_tokens=10**6)
    seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 2
    drafting = 0
    for _ in range(steps):
        proposer.propose([seq])
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        item = ScheduledSeq(seq, 1 + len(drafts), drafts)
        emitted = [7] * (len(drafts) + 1)
        sampled = SampledTokens(emitted, num_accepted=len(drafts))
        proposer.observe(ScheduledBatch(decodes=[item]), [sampled], step_cost(item.num_new_tokens))
        seq.token_ids += emitted
        seq.num_computed_tokens = seq.num_tokens - 1
        drafting += bool(drafts)
    return drafting


def test_drafts_that_pay_run_nearly_every_step():
    assert simulate(lambda rows: 1.0 + 0.1 * (rows - 1)) > 280


@pytest.mark.parametrize("per_row", [1.2, 2.0])
def test_drafts_that_cost_more_than_they_give_back_off(per_row):
    """A row costs more than a one-row step: no k pays, even at full acceptance."""
    drafting = simulate(lambda rows: 1.0 + per_row * (rows - 1))
    assert drafting <= 300 // MAX_COOLDOWN_STEPS + 8, drafting


def test_a_draft_model_stops_probing_where_nothing_could_pay():
    """Its probes are dear (a catch-up on the prompt first): once the costs say that even
    drafts all accepted would not pay, it drafts no more; where they would, it drafts."""
    assert simulate(lambda rows: 1.0 + 2.0 * (rows - 1), dear_probes=True) <= 3
    assert simulate(lambda rows: 1.0 + 0.1 * (rows - 1), dear_probes=True) > 280
