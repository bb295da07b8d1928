"""How the target accepts a step's drafts. Two ways, both emitting 1 to k + 1 tokens a step
(the accepted drafts, then one token of the target's own):

- **Sample-and-compare**: a decode's k + 1 rows are drawn in order with the request's own
  sampler, each as decoding alone would draw it (penalties over the tokens accepted so far,
  temperature, top-k/p, min-p, the request's seeded generator once per emitted token), and
  the drafts are accepted while the draw equals them. The first draw that differs, or the
  one after the last draft, is emitted too. The tokens are those of decoding without
  speculation (greedy, and seeded sampling, token for token). n-gram drafts, greedy and
  seeded requests always take it.
- **Rejection sampling** (Leviathan et al. 2023, Chen et al. 2023), for a draft model's
  drafts of a sampled request without a seed, unless the speculative config says otherwise:
  the draft model drew each draft d from its own distribution q (the request's sampler on
  the draft's logits, draft.py), and the target's row gives p (the same sampler on the
  target's logits). d is accepted with probability min(1, p(d) / q(d)); at the first
  rejection the emitted token is drawn from max(p - q, 0), renormalized; after k accepted
  drafts the last row is drawn from p. Each emitted token then has exactly the law decoding
  alone gives it (tests/engine/test_rejection_sampling.py checks the frequencies), and a
  draft is accepted with probability 1 - TV(p, q), where sample-and-compare of a greedy draft
  accepts with p(argmax q): more at temperature > 0. The draws are the engine's generator's,
  so the tokens are not those of a run without speculation.
"""

from __future__ import annotations

import torch

from pagecli.config import SpeculativeConfig
from pagecli.engine.scheduler import SampledTokens
from pagecli.engine.sequence import Sequence
from pagecli.layers.sampler import (
    SamplingRow,
    compute_logprobs,
    draw,
    greedy_ids,
    sample,
    sampling_probs,
)


def rejection_sampled(seq: Sequence, config: SpeculativeConfig) -> bool:
    """Whether `seq`'s drafts are drawn from the draft model's distribution and accepted by
    rejection sampling (module docstring): sampled, unseeded, and the config's choice."""
    params = seq.sampling_params
    return config.rejection_sampling and not params.greedy and seq.generators[0] is None


def verify(
    logits: torch.Tensor,
    seq: Sequence,
    drafts: list[int],
    default_generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> SampledTokens:
    """logits: [k + 1, V], the rows of the decoded token and of the k drafts; draft_probs:
    [k, V] where the drafts were drawn from them (rejection sampling), else None."""
    params = seq.sampling_params
    generators = seq.generators[:1]
    emitted: list[int] = []
    if draft_probs is not None:
        emitted = _rejection_sample(logits, seq, drafts, draft_probs, default_generator)
    elif params.greedy and not params.has_penalties:
        drawn = greedy_ids(logits).tolist()  # each row's argmax, as one row's would be
        for j, token in enumerate(drawn):
            emitted.append(token)
            if j == len(drafts) or token != drafts[j]:
                break
    else:
        for j in range(len(drafts) + 1):
            row = SamplingRow(
                params, generators, seq.prompt_token_ids, seq.output_token_ids + emitted
            )
            ((token,),) = sample(logits[j : j + 1], [row], default_generator)
            emitted.append(token)
            if j == len(drafts) or token != drafts[j]:
                break
    logprobs = None
    if params.logprobs is not None:
        rows = [SamplingRow(params, generators, [], []) for _ in emitted]
        found = compute_logprobs(logits[: len(emitted)], rows, [[t] for t in emitted])
        logprobs = [entry[0] for entry in found]
    return SampledTokens(emitted, logprobs, num_accepted=len(emitted) - 1)


def _rejection_sample(
    logits: torch.Tensor,
    seq: Sequence,
    drafts: list[int],
    draft_probs: torch.Tensor,
    generator: torch.Generator,
) -> list[int]:
    """The emitted tokens of rejection sampling (module docstring)."""
    params = seq.sampling_params
    emitted: list[int] = []
    for j in range(len(drafts) + 1):
        row = SamplingRow(params, [None], seq.prompt_token_ids, seq.output_token_ids + emitted)
        p = sampling_probs(logits[j], row)
        if j == len(drafts):  # every draft accepted: the target's own next token
            emitted.append(int(draw(p, generator)))
            break
        token, q = drafts[j], draft_probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        if bool(u * q[token] < p[token]):  # u < p / q: probability min(1, p / q)
            emitted.append(token)
            continue
        residual = (p - q).clamp_min_(0.0)
        if not bool(residual.sum() > 0):  # p and q equal but for rounding
            residual = p
        emitted.append(int(draw(residual, generator)))
        break
    return emitted
