"""Turns logits into token ids: penalties, temperature, top-k, top-p, min-p, per-request seeds.

Greedy rows without penalties take one batched argmax; the results come back to the host in
one transfer at the end, never one sync per request.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
            dtype=torch.long,
            device=logits.device,
        )
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        out = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits).scatter_add_(
            0, out, torch.ones_like(out, dtype=logits.dtype)
        )
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    # logits: [V] float32
    logits = logits / p.temperature
    vocab = logits.shape[-1]
    if 0 < p.top_k < vocab:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        drop_sorted = cum - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


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
        if row.params.has_penalties:
            row_logits = apply_penalties(row_logits.clone(), row)
        if row.params.greedy:
            results.append(row_logits.argmax().repeat(len(row.generators)))
            continue
        probs = _filtered_probs(row_logits, row.params)
        draws = [
            torch.multinomial(probs, 1, generator=g if g is not None else default_generator)
            for g in row.generators
        ]
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
