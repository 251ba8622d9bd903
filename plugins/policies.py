"""Built-in scheduling policies, registered through the same hook a third-party package uses.

- ``fcfs``: first come, first served. Admission by arrival; the latest arrival is preempted first;
  a waiting request never preempts a running one, so admission stops at the head of the queue
  (no request is overtaken).
- ``priority``: lower ``priority`` value first, ties by arrival. The running request with the
  largest (priority, arrival) is preempted first, and a waiting request preempts a running one of
  strictly larger priority value.

Keys end with the request id so that equal priorities and arrival times still order the same way
every time (a forked sequence ``"r#1"`` sorts after its parent ``"r"``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tandem
from tandem.interfaces import SchedulableRequest, SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    name = "fcfs"

    def sort_key(self, request: SchedulableRequest) -> Any:
        return (request.arrival_time, request.request_id)

    def select_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=self.sort_key)


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def sort_key(self, request: SchedulableRequest) -> Any:
        return (request.priority, request.arrival_time, request.request_id)

    def select_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        return max(running, key=self.sort_key)

    def should_preempt_for(self, waiting: SchedulableRequest, running: SchedulableRequest) -> bool:
        return waiting.priority < running.priority


@tandem.hookimpl
def tandem_register_schedulers(register: Callable[[str, type], None]) -> None:
    register("fcfs", FCFSPolicy)
    register("priority", PriorityPolicy)
