"""Prompt lookup (n-gram) proposals: the tokens that followed the most recent earlier
occurrence of the sequence's last n tokens, longest n first.

The index is per sequence and grows with it: each appended token records, for every n in
[min_n, max_n], that the n tokens before it were followed at its position. A proposal is then
at most (max_n - min_n + 1) dictionary lookups, whatever the sequence's length; indexing a
prompt is one pass over it. The suffix itself is indexed only once a token follows it, so a
match is always an earlier occurrence.

The index also keeps the n-grams that have been followed by two different tokens. A draft
copied from a match is "ambiguous" where the context it was copied after (the match and the
drafts before it, max_n tokens at most) is such an n-gram: the text went on in more than one
way there, and the policy learns separately how often such drafts hold (proposer.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lookup:
    """A proposal: the drafts, and which of them are ambiguous."""

    drafts: list[int]
    ambiguous: list[bool]


class NgramIndex:
    """The n-gram index of one token sequence (prompt and output)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min <= max, got {min_n}..{max_n}")
        self.min_n = min_n
        self.max_n = max_n
        # n -> (n tokens) -> the position right after their most recent occurrence
        self._next: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._ambiguous: set[tuple[int, ...]] = set()  # followed by two different tokens
        self.num_indexed = 0  # tokens of the sequence taken into the index

    def extend(self, token_ids: list[int]) -> None:
        """Take in the sequence's tokens past those indexed (`token_ids` is the whole
        sequence, of which the first `num_indexed` are already in)."""
        for pos in range(self.num_indexed, len(token_ids)):
            for n, table in self._next.items():
                if pos >= n:
                    gram = tuple(token_ids[pos - n : pos])
                    before = table.get(gram)
                    if before is not None and token_ids[before] != token_ids[pos]:
                        self._ambiguous.add(gram)
                    table[gram] = pos
        self.num_indexed = len(token_ids)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
        of `token_ids` (min_n..max_n tokens) seen before; [] when none recurs."""
        found = self.lookup(token_ids, k)
        return found.drafts if found is not None else []

    def lookup(self, token_ids: list[int], k: int) -> Lookup | None:
        """`propose`'s drafts and which of them are ambiguous (module docstring); None when
        no suffix recurs."""
        self.extend(token_ids)
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._next[n].get(tuple(token_ids[length - n :]))
            if start is not None:
                drafts = token_ids[start : start + k]
                ambiguous = []
                for j in range(len(drafts)):
                    context = min(self.max_n, n + j)  # the match and the drafts before j
                    gram = tuple(token_ids[start + j - context : start + j])
                    ambiguous.append(gram in self._ambiguous)
                return Lookup(drafts, ambiguous)
        return None
