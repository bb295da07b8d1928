"""Turns logits into token ids: penalties, temperature, top-k, top-p, min-p, per-request seeds.

Greedy rows without penalties take one batched argmax; the results come back to the host in
one transfer at the end, never one sync per request. A sampled row is filtered in one buffer
(top-p from the likeliest tokens up, without sorting the vocabulary, on the CPU) and drawn
with one uniform of its generator through the inverse of its cumulative mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagecli.outputs import TokenLogprob
from pagecli.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of logits to sample: `len(generators)` draws (n > 1 forks draw n at once)."""

    params: SamplingParams
    generators: list[torch.Generator | None]
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (transformers' rule: divide positive
    logits, multiply negative ones); presence and frequency penalties over output tokens."""
    p = row.params
    if p.repetition_penalty != 1.0:
        # a token seen twice is written twice with the same value: no need for a set (the
        # sorted set of a 4,000-token prompt costs 1 ms a step)
        seen = _ids(row.prompt_token_ids + row.output_token_ids, logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        # only the ids that occur change (a count of 0 subtracts 0): no [V] temporaries
        ids, counts = torch.unique(_ids(row.output_token_ids, logits.device), return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


# top-p takes this many of the likeliest tokens first, four times more while they all stay
TOP_P_FIRST = 64


def _ids(tokens: list[int], device: torch.device) -> torch.Tensor:
    """A list of token ids as an int64 tensor (numpy's fromiter: a quarter of torch.tensor's
    time on a list)."""
    ids = torch.from_numpy(np.fromiter(tokens, dtype=np.int64, count=len(tokens)))
    return ids if device.type == "cpu" else ids.to(device)


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] float32 logits -> the distribution to draw from: temperature, top-k, top-p
    (the smallest set of likeliest tokens whose mass reaches top_p), min-p; renormalized.
    In one new buffer, changed in place: each new [V] tensor of a large vocabulary costs its
    page faults (0.15 ms at 151,936 tokens), more than the arithmetic."""
    probs = logits.div(p.temperature)
    vocab = probs.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(probs, p.top_k).values[-1]
        probs.masked_fill_(probs < kth, float("-inf"))
    probs.sub_(probs.max()).exp_()  # softmax
    probs.div_(probs.sum())
    if p.top_p < 1.0:
        _top_p(probs, p.top_p)
    if p.min_p > 0.0:
        probs.masked_fill_(probs < p.min_p * probs.max(), 0.0)
    return probs.div_(probs.sum())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (in place) with every token past the smallest set of likeliest ones reaching
    `top_p` set to 0. A token is kept while the mass of the tokens before it (in descending
    order) is at most top_p, so once one is dropped all later ones are: the likeliest
    TOP_P_FIRST tokens (then 4x more, up to a quarter of the row) decide it without sorting
    the vocabulary (14 ms at 151,936 tokens on 2 cores, where topk(64) takes 0.3). Their
    prefix sums are those of the whole sorted row. On other devices the whole row is sorted
    at once: reading back whether the candidates sufficed would wait for the device at every
    row."""
    vocab = probs.shape[-1]
    k = min(TOP_P_FIRST, vocab) if probs.device.type == "cpu" else vocab
    while True:
        values, ids = probs.topk(k)  # descending
        keep = values.cumsum(-1) - values <= top_p
        if k == vocab or not bool(keep[-1]):
            break
        k = 4 * k if 16 * k <= vocab else vocab  # past a quarter of the row: sort it all
    return probs.zero_().index_put_((ids[keep],), values[keep])


# the inverse CDF on the CPU goes by blocks of this many ids: their sums, then one block
CDF_BLOCK = 1024


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id from a [V] distribution (not necessarily summing to 1), as a [1] tensor: one
    uniform draw of the generator, by the inverse of the cumulative mass. (torch.multinomial
    draws one exponential per token: 3.7 ms at 151,936 tokens on 2 cores, where a whole
    sampled row takes about 0.5 ms this way, its draw included.)"""
    u = torch.rand(1, generator=generator, device=probs.device, dtype=torch.float64)
    return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """The first id whose cumulative mass (float64) exceeds u ([1], in [0, 1)) times the
    total; ids of zero mass are never picked. On the CPU by blocks: the blocks' masses, the
    block where u falls, then the ids in it (a float64 cumsum of the whole row cost more than
    the rest of a draw); elsewhere by one cumsum, without a transfer to the host."""
    vocab = probs.shape[-1]
    if probs.device.type != "cpu" or vocab <= block:
        return _first_past(probs.double().cumsum(-1), u)
    whole = vocab - vocab % block
    sums = probs[:whole].view(-1, block).sum(1, dtype=torch.float64)
    if whole < vocab:
        sums = torch.cat([sums, probs[whole:].sum(dtype=torch.float64).reshape(1)])
    cdf = sums.cumsum(0)
    b = int(_first_past(cdf, u))
    before = cdf[b - 1 : b] if b else cdf.new_zeros(1)
    inside = probs[b * block : (b + 1) * block].double().cumsum(0)
    # the point u * total lies in block b; its offset there, on the block's own sums
    offset = u * cdf[-1:] - before
    return b * block + _first_past(inside, (offset / inside[-1:]).clamp_(0.0, 1.0))


def _first_past(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    total = cdf[-1:]
    picked = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to the total: the last id of positive mass then
    return torch.minimum(picked, torch.searchsorted(cdf, total))


def sampling_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution `sample` draws a sampled (temperature > 0) row from: the row's
    penalties, then temperature, top-k, top-p and min-p. logits: [V] float32 (not changed)."""
    if row.params.has_penalties:
        logits = apply_penalties(logits.clone(), row)
    return _filtered_probs(logits, row.params)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of logits [S, V] -> [S]; natively on the CPU (torch's argmax took
    5 ms for 64 x 49,152 float32 logits, see benchmarks/step_floor.py)."""
    from pagecli_kernels import fused_cpu

    if logits.dtype == torch.float32 and fused_cpu.available(logits):
        return fused_cpu.argmax(logits)
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator
) -> list[list[int]]:
    """logits: [S, V] float32, one row per entry of `rows`. Returns the drawn ids per row."""
    if all(r.params.greedy and not r.params.has_penalties for r in rows):
        ids = greedy_ids(logits).tolist()
        return [[ids[i]] * len(r.generators) for i, r in enumerate(rows)]
    results: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        row_logits = logits[i]
        if row.params.greedy:
            if row.params.has_penalties:
                row_logits = apply_penalties(row_logits.clone(), row)
            results.append(row_logits.argmax().repeat(len(row.generators)))
            continue
        probs = sampling_probs(row_logits, row)
        draws = [draw(probs, g if g is not None else default_generator) for g in row.generators]
        results.append(torch.cat(draws))
    flat = torch.cat(results).tolist()  # one device-to-host transfer for the whole batch
    out, start = [], 0
    for row in rows:
        out.append(flat[start : start + len(row.generators)])
        start += len(row.generators)
    return out


def compute_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], drawn: list[list[int]]
) -> list[list[TokenLogprob] | None]:
    """Per row, one TokenLogprob per drawn id (None for rows that did not ask for them).

    They come from the log-softmax of the same logits row that was sampled, before penalties,
    temperature and filtering: the model's own distribution, as vLLM reports it by default.
    logits: [S, V] float32.
    """
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(rows)
    if not wanted:
        return out
    index = torch.tensor(wanted, dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [W, V]
    k = max(rows[i].params.logprobs for i in wanted)
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    ids = [torch.tensor(drawn[i], dtype=torch.long, device=logits.device) for i in wanted]
    chosen = [logp[j].index_select(0, ids[j]).tolist() for j in range(len(wanted))]
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        num_top = rows[i].params.logprobs
        top = list(zip(top_ids[j][:num_top], top_vals[j][:num_top]))
        out[i] = [TokenLogprob(t, lp, top) for t, lp in zip(drawn[i], chosen[j])]
    return out
