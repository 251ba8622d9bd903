"""The compiled-grammar cache, which a client sending many one-off grammars cannot flush.

A segmented LRU: a grammar compiled once enters the small *probation* segment; only a second
request for it promotes it to the *protected* segment, which holds the grammars that are
reused. A flood of distinct grammars (one client's, or one request's many prompts with one
grammar each) churns only the probation segment; what other clients reuse stays::

    put(key) ─► probation (LRU, PROBATION_SIZE) ── get(key) hit ─► protected (LRU, PROTECTED_SIZE)
                    │ evicted: dropped                              │ evicted: back to probation
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

PROBATION_SIZE = 32
PROTECTED_SIZE = 224


class GrammarCache:
    """Not thread-safe: the caller holds its lock."""

    def __init__(self, probation_size: int = PROBATION_SIZE, protected_size: int = PROTECTED_SIZE) -> None:
        self._probation: OrderedDict[tuple, Any] = OrderedDict()
        self._protected: OrderedDict[tuple, Any] = OrderedDict()
        self._sizes = (probation_size, protected_size)

    def __contains__(self, key: tuple) -> bool:
        return key in self._protected or key in self._probation

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def get(self, key: tuple) -> Any | None:
        """The compiled grammar of ``key`` (None: not cached); a hit counts as a reuse."""
        if key in self._protected:
            self._protected.move_to_end(key)
            return self._protected[key]
        if key not in self._probation:
            return None
        compiled = self._probation.pop(key)
        self._protected[key] = compiled
        if len(self._protected) > self._sizes[1]:
            demoted, value = self._protected.popitem(last=False)
            self._put_probation(demoted, value)
        return compiled

    def put(self, key: tuple, compiled: Any) -> None:
        if key not in self:
            self._put_probation(key, compiled)

    def _put_probation(self, key: tuple, compiled: Any) -> None:
        self._probation[key] = compiled
        if len(self._probation) > self._sizes[0]:
            self._probation.popitem(last=False)
