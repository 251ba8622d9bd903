"""Prompt-lookup (n-gram) drafts for speculative decoding. Pure Python.

A sequence that repeats itself — code being edited, a quoted document, a list — often continues
the way an earlier occurrence of its last few tokens continued. The drafter looks for the
sequence's last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``) earlier in the sequence and
proposes the tokens that followed the latest such occurrence::

    tokens   ... a b c d e ... x a b c   (suffix "a b c", n = 3)
    match        ^^^^^                   the latest earlier "a b c"
    drafts             d e ...           up to num_tokens of what followed it

The model then checks all drafts in one forward pass (the scheduler gives the request
``1 + len(drafts)`` tokens); the runner keeps the longest prefix of drafts the model itself would
have produced, plus one token of its own.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence

_ITEM = array("q").itemsize


def propose_ngram(tokens: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` drafts continuing ``tokens`` (empty when no suffix of ``min_n`` to
    ``max_n`` tokens occurs earlier, or the match is followed by nothing)."""
    if num_tokens <= 0 or len(tokens) <= min_n:
        return []
    haystack = array("q", tokens).tobytes()
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        needle = haystack[(length - n) * _ITEM:]
        end = (length - 1) * _ITEM  # the match must end before the last token: it is followed
        while (at := haystack.rfind(needle, 0, end)) >= 0:
            if at % _ITEM == 0:
                start = at // _ITEM + n
                return list(tokens[start:start + num_tokens])
            end = at + len(needle) - 1  # a match straddling tokens: look further left
    return []
