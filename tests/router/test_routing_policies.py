"""The built-in routing policies on hand-computed cases: round robin's order, least-loaded's
ordering (queue length, then KV usage, then list order), prefix affinity's rendezvous choice
(recomputed here from its documented definition) and its stability when instances leave."""
from __future__ import annotations

import hashlib
import random

import pytest

from tandem.interfaces import InstanceInfo, RoutingPolicy
from tandem.plugin_manager import get_registry
from tandem.plugins.routing import LeastLoaded, PrefixAffinity, RoundRobin

A, B, C = (InstanceInfo(f"http://10.0.0.{i}:8000", "decode") for i in (1, 2, 3))


def urls(chosen: list[InstanceInfo]) -> list[str]:
    return [i.url for i in chosen]


def test_the_three_policies_are_registered_through_the_entry_point():
    registry = get_registry()
    assert {"round_robin", "least_loaded", "prefix_affinity"} <= set(registry.names("routing_policy"))
    assert registry.get("routing_policy", "round_robin") is RoundRobin
    assert registry.get("routing_policy", "least_loaded") is LeastLoaded
    assert registry.get("routing_policy", "prefix_affinity") is PrefixAffinity
    assert all(issubclass(registry.get("routing_policy", n), RoutingPolicy)
               for n in ("round_robin", "least_loaded", "prefix_affinity"))


# --------------------------------------------------------------------------- round robin


def test_round_robin_takes_the_instances_in_turn():
    policy = RoundRobin()
    assert urls([policy.select([A, B, C], []) for _ in range(5)]) == urls([A, B, C, A, B])


def test_round_robin_counts_calls_when_the_list_changes():
    policy = RoundRobin()
    # calls 0, 1, 2, 3 over lists of 3, 2, 2, 3 instances: indexes 0, 1 % 2, 2 % 2, 3 % 3
    chosen = [policy.select([A, B, C], []), policy.select([A, C], []), policy.select([A, C], []),
              policy.select([A, B, C], [])]
    assert urls(chosen) == urls([A, C, A, A])


def test_round_robin_policies_count_independently():
    prefill, decode = RoundRobin(), RoundRobin()
    assert prefill.select([A, B], []).url == A.url
    assert decode.select([A, B], []).url == A.url
    assert prefill.select([A, B], []).url == B.url


# --------------------------------------------------------------------------- least loaded


def load(base: InstanceInfo, waiting=0, running=0, kv=0.0, in_flight=0) -> InstanceInfo:
    return InstanceInfo(base.url, base.role, num_waiting=waiting, num_running=running, kv_usage=kv,
                        num_in_flight=in_flight)


@pytest.mark.parametrize("instances, expected", [
    # queue lengths 3, 2, 4 → B
    ([load(A, waiting=2, running=1), load(B, running=2), load(C, waiting=1, running=3)], B),
    # equal queues (2): the lower KV usage wins
    ([load(A, running=2, kv=0.5), load(B, waiting=1, running=1, kv=0.3)], B),
    # the queue wins over KV usage: 1 request at 90% beats 2 requests at 10%
    ([load(A, running=1, kv=0.9), load(B, running=2, kv=0.1)], A),
    # all equal: the first in the list
    ([load(A, running=1, kv=0.2), load(B, running=1, kv=0.2)], A),
    # the router's in-flight count when it exceeds the reported queue: max(1, 4) = 4 > 3
    ([load(A, running=1, in_flight=4), load(B, running=3)], B),
    # the reported queue when it exceeds the in-flight count: max(5, 2) = 5 > 4
    ([load(A, waiting=3, running=2, in_flight=2), load(B, running=4)], B),
    # idle instances only differ by KV usage
    ([load(A, kv=0.7), load(B, kv=0.6), load(C, kv=0.65)], B),
])
def test_least_loaded_prefers_short_queues_then_free_kv(instances, expected):
    assert LeastLoaded().select(instances, [1, 2, 3]).url == expected.url


# --------------------------------------------------------------------------- prefix affinity


def expected_affinity(instances: list[InstanceInfo], key: list[int]) -> InstanceInfo:
    """The documented choice: highest sha256(url + "\\n" + first 256 ids as little-endian int64)."""
    packed = b"".join(t.to_bytes(8, "little", signed=True) for t in key[:256])
    return max(instances, key=lambda i: hashlib.sha256(i.url.encode() + b"\n" + packed).digest())


def test_prefix_affinity_matches_its_definition():
    rng = random.Random(0)
    policy = PrefixAffinity()
    for _ in range(50):
        key = [rng.randrange(32000) for _ in range(rng.randrange(1, 400))]
        assert policy.select([A, B, C], key).url == expected_affinity([A, B, C], key).url


def test_prefix_affinity_ignores_everything_after_the_prefix():
    rng = random.Random(1)
    shared = [rng.randrange(512) for _ in range(256)]
    policy = PrefixAffinity()
    chosen = {policy.select([A, B, C], shared + [rng.randrange(512) for _ in range(n)]).url
              for n in range(1, 30)}
    assert chosen == {policy.select([A, B, C], shared).url}


def test_prefix_affinity_does_not_depend_on_the_list_order():
    key = list("You are a helpful assistant.".encode())
    policy = PrefixAffinity()
    assert policy.select([A, B, C], key).url == policy.select([C, A, B], key).url


def test_prefix_affinity_moves_only_the_prompts_of_an_instance_that_leaves():
    rng = random.Random(2)
    policy = PrefixAffinity()
    keys = [[rng.randrange(32000) for _ in range(20)] for _ in range(200)]
    before = [policy.select([A, B, C], k).url for k in keys]
    after = [policy.select([A, C], k).url for k in keys]
    for was, now in zip(before, after):
        if was != B.url:
            assert now == was
    assert B.url in before


def test_prefix_affinity_spreads_distinct_prefixes():
    rng = random.Random(3)
    policy = PrefixAffinity()
    chosen = [policy.select([A, B, C], [rng.randrange(32000) for _ in range(8)]).url for _ in range(300)]
    assert all(chosen.count(i.url) >= 60 for i in (A, B, C))  # 100 each expected
