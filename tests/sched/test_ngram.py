"""The n-gram drafter against hand-worked sequences."""
from __future__ import annotations

import pytest

from tandem.sched.ngram import propose_ngram


@pytest.mark.parametrize("tokens, k, min_n, max_n, drafts", [
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 1, 3, [4, 5, 9]),      # "1 2 3" seen before: what followed it
    ([1, 2, 3, 4, 1, 2, 3], 9, 2, 3, [4, 1, 2, 3]),         # at most to the end of the sequence
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], 2, 1, 3, [4, 5]),         # at most k
    ([3, 8, 2, 3, 7, 2, 3], 2, 1, 2, [7, 2]),               # the latest earlier occurrence wins
    ([3, 8, 1, 2, 3], 2, 1, 3, [8, 1]),                     # a shorter n when the longer fails
    ([3, 8, 1, 2, 3], 2, 2, 3, []),                         # ... but not below min_n
    ([1, 2, 3], 2, 1, 3, []),                               # no earlier occurrence
    ([7, 7, 7, 7], 2, 1, 2, [7]),                           # overlapping runs
    ([256, 1, 0, 0, 0, 1], 2, 1, 1, [0, 0]),                # byte patterns that straddle tokens
    ([5, 1 << 40, 5], 1, 1, 1, [1 << 40]),                  # large ids
    ([1, 2, 1, 2], 0, 1, 2, []),                            # k = 0
    ([4], 3, 1, 2, []),                                     # too short
])
def test_propose_ngram(tokens, k, min_n, max_n, drafts):
    assert propose_ngram(tokens, k, min_n, max_n) == drafts
