"""The router's instance registry: roles and rotation, in-flight counts, and the load read from
an instance's Prometheus text (written by hand in the format of docs/metrics.md)."""
from __future__ import annotations

import pytest

from tandem.router.registry import DuplicateInstance, InstanceRegistry, Load, parse_load

METRICS = """\
# HELP tandem:num_requests_running Requests in the running batch.
# TYPE tandem:num_requests_running gauge
tandem:num_requests_running 3.0
# HELP tandem:num_requests_waiting Requests waiting to be scheduled.
# TYPE tandem:num_requests_waiting gauge
tandem:num_requests_waiting 7.0
# HELP tandem:kv_cache_usage_perc Fraction of KV blocks in use (0-1).
# TYPE tandem:kv_cache_usage_perc gauge
tandem:kv_cache_usage_perc 0.25
# HELP tandem:prompt_tokens_total Prompt tokens computed.
# TYPE tandem:prompt_tokens_total counter
tandem:prompt_tokens_total 120.0
"""


def registry() -> InstanceRegistry:
    reg = InstanceRegistry([("http://p", "prefill"), ("http://d", "decode"), ("http://b", "both")])
    for state in reg.all():
        state.healthy = True
    return reg


def test_parse_load_reads_the_three_gauges():
    assert parse_load(METRICS) == Load(num_waiting=7, num_running=3, kv_usage=0.25)


def test_parse_load_without_the_gauges_is_none():
    assert parse_load("tandem:prompt_tokens_total 1.0\n") is None


def test_both_instances_serve_either_step():
    reg = registry()
    assert [i.url for i in reg.candidates("prefill")] == ["http://p", "http://b"]
    assert [i.url for i in reg.candidates("decode")] == ["http://d", "http://b"]
    assert [i.url for i in reg.candidates("decode", exclude={"http://d"})] == ["http://b"]


def test_new_instances_are_out_of_rotation_until_checked():
    reg = InstanceRegistry([("http://d", "decode")])
    assert reg.candidates("decode") == []
    assert reg.get("http://d").reason == "not checked yet"


def test_mark_down_takes_an_instance_out_of_rotation():
    reg = registry()
    reg.mark_down("http://b", "answered 503")
    assert [i.url for i in reg.candidates("decode")] == ["http://d"]
    assert reg.get("http://b").as_dict()["reason"] == "answered 503"
    reg.mark_down("http://gone", "unknown URLs are ignored")


def test_in_flight_counts_while_the_block_runs_and_reaches_the_policies():
    reg = registry()
    with reg.in_flight("http://d"), reg.in_flight("http://d"):
        assert reg.candidates("decode")[0].num_in_flight == 2
    assert reg.get("http://d").num_in_flight == 0


def test_in_flight_of_a_removed_instance_is_harmless():
    reg = registry()
    with reg.in_flight("http://d"):
        reg.remove("http://d")
    assert reg.get("http://d") is None


def test_add_refuses_duplicates_and_unknown_roles():
    reg = registry()
    with pytest.raises(DuplicateInstance, match="already registered"):
        reg.add("http://d", "decode")
    with pytest.raises(ValueError, match="unknown role 'router'"):
        reg.add("http://x", "router")
    with pytest.raises(KeyError):
        reg.remove("http://x")


@pytest.mark.parametrize("url", ["http://[::1", "http://[::1]:x", "http://", "mailto:someone"])
def test_add_refuses_urls_httpx_cannot_send_to(url):
    reg = registry()
    with pytest.raises(ValueError, match="not a URL the router can send to") as refused:
        reg.add(url, "decode")
    assert not isinstance(refused.value, DuplicateInstance)
    assert [s.url for s in reg.all()] == ["http://p", "http://d", "http://b"]


def test_has_role_counts_unhealthy_instances_too():
    reg = InstanceRegistry([("http://p", "prefill"), ("http://d", "decode")])
    assert reg.has_role("prefill") and not reg.has_role("both")
