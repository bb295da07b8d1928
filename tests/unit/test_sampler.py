"""The sampler's filters and draws (pagecli/layers/sampler.py): top-p without sorting the
vocabulary keeps the set the full sort keeps, and one uniform per draw picks ids with their
probabilities, never one of zero mass."""

from __future__ import annotations

import pytest
import torch

from pagecli.layers.sampler import (
    TOP_P_FIRST,
    SamplingRow,
    _filtered_probs,
    _top_p,
    apply_penalties,
    draw,
    inverse_cdf,
    sample,
)
from pagecli.sampling_params import SamplingParams
from tests.stats import chi_square_p_value


def _top_p_by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The rule written over the whole sorted row: the reference."""
    sorted_probs, order = probs.sort(descending=True)
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs > top_p
    drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
@pytest.mark.parametrize(
    "scale", [0.3, 2.0, 8.0]
)  # flat (the boundary past 4x TOP_P_FIRST) to peaked
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_set_the_whole_sort_keeps(vocab, scale, top_p):
    generator = torch.Generator().manual_seed(vocab + int(10 * scale))
    probs = torch.softmax(torch.randn(vocab, generator=generator) * scale, dim=-1)
    fast, slow = _top_p(probs, top_p), _top_p_by_sorting(probs, top_p)
    assert torch.equal(fast, slow)
    kept = int((fast > 0).sum())
    assert kept >= 1
    if vocab == 49152 and scale == 0.3 and top_p >= 0.9:
        assert kept > 4 * TOP_P_FIRST  # the candidates grew


def test_filters_compose_top_k_top_p_and_min_p():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.5, 0.0, -1.0, -5.0])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, min_p=0.1)
    probs = _filtered_probs(logits, params)
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    assert (probs[4:] == 0).all()  # past top-k
    ref = torch.softmax(logits[:4], -1)
    ref = _top_p_by_sorting(ref, 0.9)
    ref = ref.masked_fill(ref < 0.1 * ref.max(), 0.0)
    assert torch.allclose(probs[:4], ref / ref.sum())


def test_draws_have_the_distribution_and_skip_ids_of_no_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]) * 3  # not normalized
    generator = torch.Generator().manual_seed(1)
    n = 30000
    ids = torch.cat([draw(probs, generator) for _ in range(n)])
    counts = torch.bincount(ids, minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    assert chi_square_p_value(counts, probs) > 1e-4


@pytest.mark.parametrize("block", [2, 3, 1024])  # by blocks (the last one short), by one cumsum
def test_inverse_cdf_at_the_ends_of_the_unit_interval(block):
    probs = torch.tensor([0.0, 0.0, 0.25, 0.75, 0.0, 0.0, 0.0])
    lowest = torch.tensor([0.0], dtype=torch.float64)
    highest = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    assert int(inverse_cdf(probs, lowest, block)) == 2
    assert int(inverse_cdf(probs, highest, block)) == 3
    # a total whose product with u rounds up to itself still picks an id of positive mass
    assert int(inverse_cdf(probs * 3.0, torch.tensor([1.0], dtype=torch.float64), block)) == 3


def test_the_blocks_pick_the_ids_of_one_cumsum():
    generator = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(5000, generator=generator) * 2, -1)
    probs[torch.rand(5000, generator=generator) < 0.3] = 0.0
    for _ in range(500):
        u = torch.rand(1, generator=generator, dtype=torch.float64)
        by_blocks = int(inverse_cdf(probs, u, block=64))
        assert by_blocks == int(inverse_cdf(probs, u, block=10**6))
        assert probs[by_blocks] > 0


def test_a_seed_gives_the_same_draws():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=3)
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(3)) * 3

    def run():
        rows = [
            SamplingRow(params, [torch.Generator().manual_seed(7 + i) for i in range(3)], [], [])
            for _ in range(2)
        ]
        return sample(logits, rows, torch.Generator().manual_seed(0))

    first, second = run(), run()
    assert first == second
    assert len({tuple(r) for r in first}) > 1 or len(set(first[0])) > 1  # not one id always


def _penalties_over_the_vocabulary(logits, params, prompt, output):
    """The penalties as whole-vocabulary tensors: the reference."""
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
        )
    if params.presence_penalty or params.frequency_penalty:
        out = torch.tensor(output, dtype=torch.long)
        counts = torch.zeros_like(logits).scatter_add_(0, out, torch.ones_like(out).float())
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


@pytest.mark.parametrize(
    "penalties",
    [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.9},
        {"presence_penalty": 0.7, "frequency_penalty": 0.3},
        {"repetition_penalty": 1.1, "presence_penalty": -0.5, "frequency_penalty": 1.1},
    ],
)
def test_penalties_touch_only_the_seen_ids_with_the_same_bits(penalties):
    generator = torch.Generator().manual_seed(len(penalties))
    logits = torch.randn(5000, generator=generator) * 3
    prompt = torch.randint(0, 5000, (300,), generator=generator).tolist()
    output = torch.randint(0, 5000, (200,), generator=generator).tolist() + [7] * 5
    params = SamplingParams(temperature=0.8, **penalties)
    got = apply_penalties(logits.clone(), SamplingRow(params, [None], prompt, output))
    assert torch.equal(got, _penalties_over_the_vocabulary(logits, params, prompt, output))
    assert not torch.equal(got, logits)
