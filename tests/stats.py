"""A statistical check the sampling tests share."""

from __future__ import annotations

import torch


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of observed `counts` per id under the distribution `probs` (normalized
    here) by Pearson's chi-square; 0.0 where an id of zero probability was observed."""
    possible = probs > 0
    if bool((counts[~possible] > 0).any()):
        return 0.0
    expected = counts.sum() * probs[possible].double() / probs[possible].double().sum()
    stat = (((counts[possible].double() - expected) ** 2) / expected).sum()
    df = int(possible.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))
