"""benchmarks/spec_lookup_bound.py's replay: the n-gram proposer's steps and the oracle's,
on token sequences small enough to count by hand."""

from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
try:
    import spec_lookup_bound as bound
finally:
    sys.path.pop(0)

# a step costs its rows: 1 for a token without drafts, 1 more a draft
COSTS = {rows: float(rows) for rows in range(1, 10)}


def test_the_oracle_takes_the_occurrence_the_reply_follows_longest():
    #          0  1  2  3  4  5  6  7  8
    prompt = [5, 1, 2, 3, 9, 1, 2, 4, 8]
    # the suffix [8] never occurred before; [1, 2] at 1 (then 3) and 5 (then 4)
    assert bound._oracle(prompt + [1, 2], [3, 9, 1], k=3, most_n=5) == 3
    assert bound._oracle(prompt + [1, 2], [4, 8, 7], k=3, most_n=5) == 2
    assert bound._oracle(prompt + [1, 2], [3, 9, 1], k=2, most_n=5) == 2  # at most k
    assert bound._oracle(prompt + [1, 2], [6], k=3, most_n=5) == 0
    assert bound._accepted([3, 9, 7], [3, 9, 1]) == 2


def test_replay_counts_tokens_a_step_and_the_time_against_one_row_a_token():
    prompt = [5, 1, 2, 3, 4, 6]
    reply = [1, 2, 3, 4, 7]
    # n-gram (2..5), k = 3: [.., 4, 6] unseen: no drafts, emits 1; then [6, 1] unseen: emits
    # 2; [1, 2] matched at 1: drafts [3, 4, 6], accepts 2, emits 3 (3, 4, 7): 3 steps of 1,
    # 1 and 4 rows for 5 tokens
    result = bound.replay([(prompt, reply)], 3, COSTS, 2, 5)
    assert result["ngram"]["tokens_per_step"] == 5 / 3
    assert result["ngram"]["speedup"] == 5 / 6
    # the oracle: nothing before [6] either, emits 1 at 1 row; then takes [1] (at 1, then 2,
    # 3, 4), all 3 accepted: emits [2, 3, 4, 7] at 4 rows: 5 tokens in 2 steps, 5 rows' time
    assert result["oracle"]["tokens_per_step"] == 5 / 2
    assert result["oracle"]["speedup"] == 1.0
