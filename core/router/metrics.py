"""The router's Prometheus metrics (its own registry; an instance's metrics stay on the instance).

Every metric, label, outcome (``OUTCOMES``) and dispatch path: docs/metrics.md. Time
to first token runs from the router receiving the request to it relaying the first event that
carries a token — prefill, hand-over and the first decode step as the client sees them, less its
own network.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.router.registry import InstanceRegistry, Step

OUTCOMES = ("ok", "error", "busy", "unavailable", "unreachable", "broken")

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                      1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0)


class _InstanceCollector(Collector):
    """Health and in-flight gauges, read from the registry at scrape time."""

    def __init__(self, instances: InstanceRegistry) -> None:
        self._instances = instances

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily("tandem:router_instance_healthy",
                                    "1 while the instance is in rotation.", labels=["instance", "role"])
        in_flight = GaugeMetricFamily("tandem:router_instance_in_flight",
                                      "Requests the router has on the instance now.",
                                      labels=["instance", "role"])
        for state in self._instances.all():
            healthy.add_metric([state.url, state.role], 1.0 if state.healthy else 0.0)
            in_flight.add_metric([state.url, state.role], state.num_in_flight)
        yield healthy
        yield in_flight


class RouterMetrics:
    def __init__(self, instances: InstanceRegistry) -> None:
        r = self.registry = CollectorRegistry()
        self.upstream = Counter("tandem:router_upstream_requests",
                                "Requests the router sent instances, by instance, step and outcome.",
                                ["instance", "step", "outcome"], registry=r)
        self.requests = Counter("tandem:router_requests", "Client requests by dispatch path.",
                                ["path"], registry=r)
        self.ttft = Histogram("tandem:router_time_to_first_token_seconds",
                              "Time to first token of streamed requests, measured at the router.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem:router_e2e_request_latency_seconds",
                             "Request latency at the router, end to end.", buckets=_E2E_BUCKETS_S,
                             registry=r)
        r.register(_InstanceCollector(instances))

    def attempt(self, url: str, step: Step, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        self.upstream.labels(instance=url, step=step, outcome=outcome).inc()

    def dispatched(self, plan: str) -> None:
        """Count a request dispatched as ``plan`` (a ``tandem.router.dispatch.Plan``)."""
        self.requests.labels(path=plan).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
