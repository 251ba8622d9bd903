"""Built-in routing policies of the disaggregation router, registered through the same hook a
third-party package uses. Each router keeps one policy object for prefill choices and another
for decode choices, so a stateful policy (round robin) counts each role on its own.

- ``round_robin``: the instances in turn: the k-th call (from 0) picks ``instances[k % len]``.
- ``least_loaded``: the instance with the shortest queue, then the lowest KV usage, then the
  first in the list. Queue length is ``max(num_waiting + num_running, num_in_flight)``: what the
  instance reported at its last health check (which lags by up to one check period) or what the
  router itself has sent it and not yet seen finish (which misses other clients), whichever is
  larger.
- ``prefix_affinity``: prompts that share their first ``prefix_length`` ids go to the same
  instance, so that its prefix cache serves them. Rendezvous hashing: every instance gets the
  score ``sha256(url + "\\n" + prefix as little-endian int64s)`` and the highest score wins, so
  when an instance leaves rotation only the prompts it held move, each to its next choice.
- ``cache_aware`` (``tandem.plugins.cache_aware``): the instance whose prefix cache, as its KV
  events tell, holds the longest run of the prompt's leading blocks.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import ClassVar

import tandem
from tandem.interfaces import InstanceInfo, RoutingPolicy


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._calls = 0

    def select(self, instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
        chosen = instances[self._calls % len(instances)]
        self._calls += 1
        return chosen


def queue_length(instance: InstanceInfo) -> int:
    """Requests on ``instance`` as the router best knows them (see the module docstring)."""
    return max(instance.num_waiting + instance.num_running, instance.num_in_flight)


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def select(self, instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
        return min(instances, key=lambda i: (queue_length(i), i.kv_usage))


def affinity_score(url: str, prefix: Sequence[int]) -> bytes:
    """The rendezvous score of ``url`` for a prompt prefix (compared as bytes, highest wins)."""
    packed = struct.pack(f"<{len(prefix)}q", *prefix)
    return hashlib.sha256(url.encode() + b"\n" + packed).digest()


class PrefixAffinity(RoutingPolicy):
    name = "prefix_affinity"
    prefix_length: ClassVar[int] = 256
    """How many leading ids of the prompt key decide the instance (256 text bytes are about 64
    tokens, four blocks of 16)."""

    def select(self, instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
        prefix = list(prompt_token_ids[: self.prefix_length])
        return max(instances, key=lambda i: affinity_score(i.url, prefix))


@tandem.hookimpl
def tandem_register_routing_policies(register: Callable[[str, type], None]) -> None:
    register("round_robin", RoundRobin)
    register("least_loaded", LeastLoaded)
    register("prefix_affinity", PrefixAffinity)
    from tandem.plugins.cache_aware import CacheAware  # it builds on queue_length above

    register("cache_aware", CacheAware)
