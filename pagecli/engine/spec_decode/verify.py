"""Verification by sample-and-compare: a decode's k + 1 rows are drawn in order with the
request's own sampler, each as decoding alone would draw it (penalties over the tokens
accepted so far, temperature, top-k/p, min-p, the request's seeded generator once per
emitted token), and the drafts are accepted while the draw equals them. The first draw that
differs, or the one after the last draft, is emitted too: every step emits 1 to k + 1
tokens, and they are the tokens decoding without speculation gives (greedy, and seeded
sampling, token for token)."""

from __future__ import annotations

import torch

from pagecli.engine.scheduler import SampledTokens
from pagecli.engine.sequence import Sequence
from pagecli.layers.sampler import SamplingRow, compute_logprobs, greedy_ids, sample


def verify(
    logits: torch.Tensor,
    seq: Sequence,
    drafts: list[int],
    default_generator: torch.Generator,
) -> SampledTokens:
    """logits: [k + 1, V], the rows of the decoded token and of the k drafts."""
    params = seq.sampling_params
    generators = seq.generators[:1]
    emitted: list[int] = []
    if params.greedy and not params.has_penalties:
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
