"""Rejection sampling of a draft model's drafts (engine/spec_decode/verify.py): each emitted
token has the law of the target's own sampler, whatever the draft's distribution; a draft is
accepted with probability 1 - TV(p, q); greedy and seeded requests keep sample-and-compare.

The distribution test draws drafts from fixed draft distributions q, checks them against
fixed target rows with temperature, top-k and top-p (so p is zero where q is not), and
compares the frequencies of the emitted tokens at each position with p by a chi-square test
(a seeded generator: the same draws every run)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagecli import SamplingParams
from pagecli.config import SpeculativeConfig
from pagecli.engine.spec_decode.verify import rejection_sampled, verify
from pagecli.layers.sampler import SamplingRow, sampling_probs
from tests.engine.test_spec_decode import PROMPTS
from tests.engine.test_spec_draft import SELF_DRAFT, run
from tests.sizes import size
from tests.stats import chi_square_p_value

PARAMS = SamplingParams(temperature=0.8, top_k=5, top_p=0.95)
TARGET = torch.tensor(
    [
        [2.0, 1.5, 0.3, -0.5, 0.9, -2.0],
        [0.1, 0.2, 1.8, 1.7, -1.0, 0.0],
        [-0.3, 0.4, 0.0, 2.2, 0.5, 1.1],
    ]
)
# draft distributions unlike the target's rows: mass where p has none (id 5 of row 0 is past
# top-k), and the target's favourite under-weighted
DRAFT = torch.tensor(
    [
        [0.10, 0.45, 0.10, 0.05, 0.05, 0.25],
        [0.30, 0.05, 0.05, 0.50, 0.05, 0.05],
    ]
)


def _seq(params: SamplingParams = PARAMS, seed_generator=None) -> SimpleNamespace:
    return SimpleNamespace(
        sampling_params=params,
        generators=[seed_generator],
        prompt_token_ids=[1, 2],
        output_token_ids=[],
    )


def _target_probs(row: int) -> torch.Tensor:
    return sampling_probs(TARGET[row], SamplingRow(PARAMS, [None], [1, 2], []))


def _trials(n: int, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    seq = _seq()
    runs = []
    for _ in range(n):
        drafts = [int(torch.multinomial(q, 1, generator=generator)) for q in DRAFT]
        sampled = verify(TARGET, seq, drafts, generator, DRAFT)
        assert sampled.num_accepted == len(sampled.token_ids) - 1
        assert sampled.token_ids[: sampled.num_accepted] == drafts[: sampled.num_accepted]
        runs.append(sampled.token_ids)
    return runs


def test_each_emitted_token_has_the_target_law():
    runs = _trials(size(12000, 60000))
    vocab = TARGET.shape[1]
    for position in range(3):
        tokens = torch.tensor([r[position] for r in runs if len(r) > position])
        assert tokens.numel() > 500, position
        counts = torch.bincount(tokens, minlength=vocab)
        p_value = chi_square_p_value(counts, _target_probs(position))
        assert p_value > 1e-4, (position, counts.tolist(), _target_probs(position).tolist())


def test_a_draft_is_accepted_with_probability_one_minus_the_total_variation():
    runs = _trials(size(12000, 60000), seed=4)
    n = len(runs)
    accepted = sum(len(r) > 1 for r in runs) / n
    p, q = _target_probs(0), DRAFT[0]
    expected = float(torch.minimum(p, q).sum())  # 1 - TV(p, q)
    assert abs(accepted - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (
        accepted,
        expected,
    )
    # sample-and-compare of the draft's likeliest token accepts with p(argmax q): less here
    assert expected > float(p[int(q.argmax())]) + 0.1


def test_which_requests_are_rejection_sampled():
    draft = SpeculativeConfig(method="draft_model", model="d")
    assert draft.rejection_sampling
    assert rejection_sampled(_seq(), draft)
    assert not rejection_sampled(_seq(SamplingParams(temperature=0)), draft)
    assert not rejection_sampled(_seq(seed_generator=torch.Generator()), draft)
    compare = SpeculativeConfig(
        method="draft_model", model="d", acceptance_method="sample_and_compare"
    )
    assert not rejection_sampled(_seq(), compare)
    assert not SpeculativeConfig().rejection_sampling  # n-gram drafts have no distribution
    with pytest.raises(ValueError, match="rejection_sampler needs a draft"):
        SpeculativeConfig.parse('{"acceptance_method": "rejection_sampler"}')
    with pytest.raises(ValueError, match="acceptance_method must be one of"):
        SpeculativeConfig.parse('{"model": "d", "acceptance_method": "typical"}')


def test_the_model_as_its_own_draft_is_accepted_nearly_always_at_temperature():
    """p and q come from the same weights: rejection sampling accepts nearly every draft,
    where sample-and-compare accepts the draft's greedy token only as often as the target
    draws it."""
    params = SamplingParams(temperature=1.0, max_tokens=size(32, 96))
    prompts = PROMPTS[3:4] + PROMPTS[1:2]
    _, rejection = run(prompts, params, SELF_DRAFT)
    compare_spec = dict(SELF_DRAFT, acceptance_method="sample_and_compare")
    _, compare = run(prompts, params, compare_spec)
    assert rejection.spec_draft_tokens > 0 and compare.spec_draft_tokens > 0
    assert rejection.spec_acceptance_rate > 0.9, rejection.spec_acceptance_rate
    assert rejection.spec_acceptance_rate > compare.spec_acceptance_rate + 0.1, (
        rejection.spec_acceptance_rate,
        compare.spec_acceptance_rate,
    )


def test_sampled_requests_finish_with_a_draft_that_guesses_badly(random_draft):
    """Most drafts rejected: each step emits the residual's token and rolls back; the engine's
    invariants hold and every block is freed (`run` checks both)."""
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=size(24, 64))
    spec = {"model": str(random_draft), "num_speculative_tokens": 3}
    prompts = PROMPTS[: size(3, 5)]
    outputs, stats = run(prompts, params, spec, max_num_seqs=4)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outputs)
    assert stats.spec_draft_tokens > 0
    assert stats.spec_acceptance_rate < 0.5
