"""The shortest-prompt-first order and victim choice, on hand-computed cases."""
from __future__ import annotations

from dataclasses import dataclass, field

import tandem_spf
from tandem.interfaces import SchedulingPolicy
from tandem_spf.policy import ShortestPromptFirstPolicy


@dataclass
class FakeRequest:
    """Just what ``tandem.interfaces.SchedulableRequest`` promises a policy."""

    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    num_tokens: int = 0
    num_computed_tokens: int = 0
    priority: int = 0
    all_token_ids: list[int] = field(default_factory=list)


def test_waiting_requests_are_ordered_by_prompt_length_then_arrival():
    policy = ShortestPromptFirstPolicy()
    waiting = [
        FakeRequest("long", num_prompt_tokens=300, arrival_time=0.0),
        FakeRequest("short-late", num_prompt_tokens=5, arrival_time=2.0),
        FakeRequest("mid", num_prompt_tokens=40, arrival_time=1.0),
        FakeRequest("short-early", num_prompt_tokens=5, arrival_time=1.5),
    ]
    order = [r.request_id for r in sorted(waiting, key=policy.sort_key)]
    assert order == ["short-early", "short-late", "mid", "long"]


def test_victim_has_the_most_tokens_left_to_compute():
    policy = ShortestPromptFirstPolicy()
    running = [
        FakeRequest("decoding", 10, 0.0, num_tokens=30, num_computed_tokens=29),     # 1 left
        FakeRequest("chunked", 500, 1.0, num_tokens=500, num_computed_tokens=256),   # 244 left
        FakeRequest("new", 100, 2.0, num_tokens=100, num_computed_tokens=0),         # 100 left
    ]
    assert policy.select_victim(running).request_id == "chunked"


def test_victim_ties_go_to_the_latest_arrival():
    policy = ShortestPromptFirstPolicy()
    running = [
        FakeRequest("late", 10, 5.0, num_tokens=11, num_computed_tokens=10),
        FakeRequest("early", 10, 1.0, num_tokens=11, num_computed_tokens=10),
    ]
    assert policy.select_victim(running).request_id == "late"


def test_full_ties_go_to_the_request_scheduled_last():
    policy = ShortestPromptFirstPolicy()
    running = [FakeRequest(f"r{i}", 10, 1.0, num_tokens=11, num_computed_tokens=10) for i in range(3)]
    assert policy.select_victim(running).request_id == "r2"


def test_registers_spf_as_a_scheduling_policy():
    registered = {}
    tandem_spf.tandem_register_schedulers(register=registered.__setitem__)
    assert registered == {"spf": ShortestPromptFirstPolicy}
    assert issubclass(ShortestPromptFirstPolicy, SchedulingPolicy)
    assert ShortestPromptFirstPolicy().max_prompt_tokens_per_step() is None
