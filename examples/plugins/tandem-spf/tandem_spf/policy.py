"""Shortest prompt first: admit the waiting request with the fewest prompt tokens.

Short prompts finish their prefill quickly, so admitting them first lowers the mean time to first
token when long and short prompts queue together (at the cost of delaying long prompts under
sustained load). When blocks run out, the running request with the most tokens still to compute
is preempted: it would hold its blocks the longest before producing its next token.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from tandem.interfaces import SchedulableRequest, SchedulingPolicy


class ShortestPromptFirstPolicy(SchedulingPolicy):
    """Waiting order ``(num_prompt_tokens, arrival_time)``; victim: most tokens left to compute
    (``num_tokens - num_computed_tokens``), ties to the latest arrival, then to the request
    scheduled last."""

    name: ClassVar[str] = "spf"

    def sort_key(self, request: SchedulableRequest) -> tuple[int, float]:
        return request.num_prompt_tokens, request.arrival_time

    def select_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        # max() keeps the first of equal keys; scanning backwards makes that the one scheduled last.
        return max(
            reversed(running),
            key=lambda r: (r.num_tokens - r.num_computed_tokens, r.arrival_time),
        )
