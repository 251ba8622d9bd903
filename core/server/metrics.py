"""Prometheus metrics of one server, with the names of docs/metrics.md.

Each app has its own ``CollectorRegistry`` (several apps can live in one process, as in tests).
Three sources feed it:

- gauges and cumulative counters (running/waiting requests, KV blocks, prefix cache, preemptions)
  are read at scrape time from the ``EngineSnapshot`` the engine thread publishes;
- per-step histograms and token counters are observed on the engine thread (``observe_step``);
- per-request latencies are observed on the event loop by a ``RequestTimer`` as outputs reach
  the HTTP layer, so they measure what a client sees, minus the network.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.async_engine import EngineSnapshot
from tandem.engine import StepStats
from tandem.kv_transfer import KVTransferStats
from tandem.outputs import RequestOutput

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                      0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine thread's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        kv = s.kv
        gauges = [
            ("tandem:num_requests_running", "Requests in the running batch.", s.num_running),
            ("tandem:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", kv.usage if kv else 0.0),
            ("tandem:kv_blocks_used", "KV blocks in use.", kv.num_used_blocks if kv else 0),
            ("tandem:kv_blocks_total", "Usable KV blocks.", kv.num_blocks if kv else 0),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             kv.prefix_cache_queries if kv else 0),
            ("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             kv.prefix_cache_hits if kv else 0),
            ("tandem:num_preemptions", "Preemptions of running requests.", s.num_preemptions),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield from _kv_transfer_metrics(s.kv_transfer or KVTransferStats())


def _kv_transfer_metrics(stats: KVTransferStats) -> Iterator[Metric]:
    yield CounterMetricFamily("tandem:kv_transfer_bytes", "KV bytes read from prefill instances.",
                              value=stats.bytes_total)
    yield CounterMetricFamily("tandem:kv_transfer_reads", "KV reads posted to prefill instances (a "
                              "streamed hand-over posts one per announced run of blocks).",
                              value=stats.reads_total)
    failures = CounterMetricFamily("tandem:kv_transfer_failures",
                                   "KV hand-overs that failed (decode side: peer, deadline, transfer, "
                                   "mismatch, checksum; prefill side: expired).", labels=["reason"])
    for reason, count in stats.failures:
        failures.add_metric([reason], count)
    yield failures
    events = CounterMetricFamily("tandem:kv_connector_events",
                                 "KV connector events by name (the faulty connector: faults injected).",
                                 labels=["event"])
    for event, count in stats.connector_events:
        events.add_metric([event], count)
    yield events
    yield GaugeMetricFamily("tandem:kv_blocks_pending_release",
                            "KV blocks pinned for decode instances, not yet released.",
                            value=stats.pending_release_blocks)
    yield GaugeMetricFamily("tandem:kv_blocks_quarantined",
                            "KV blocks a read past its deadline may still write into, held out of "
                            "the free pool until it is over.", value=stats.num_quarantined_blocks)


class ServerMetrics:
    """The metrics of one server. ``track(snapshot)`` connects the engine's snapshot."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens computed.", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated.", registry=r)
        self.draft_tokens = Counter("tandem:spec_decode_num_draft_tokens",
                                    "Speculative decoding: draft tokens checked.", registry=r)
        self.accepted_tokens = Counter("tandem:spec_decode_num_accepted_tokens",
                                       "Speculative decoding: draft tokens the model accepted.", registry=r)
        self.iteration_tokens = Histogram("tandem:iteration_tokens", "Tokens computed per engine step.",
                                          buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_size = Histogram("tandem:batch_size", "Sequences per engine step.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("tandem:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_E2E_BUCKETS_S, registry=r)
        self.success = Counter("tandem:request_success", "Finished requests by finish reason.",
                               ["finish_reason"], registry=r)
        self.errors = Counter("tandem:request_errors", "Failed requests by reason.", ["reason"],
                              registry=r)
        self.kv_transfer_seconds = Histogram("tandem:kv_transfer_seconds",
                                             "Duration of one request's KV read from a prefill instance.",
                                             buckets=_LATENCY_BUCKETS_S, registry=r)

    def track(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry.register(_EngineCollector(snapshot))

    def observe_step(self, stats: StepStats) -> None:
        """Called on the engine thread after every step."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted_tokens.inc(stats.num_accepted_draft_tokens)
        self.iteration_tokens.observe(stats.num_tokens)
        self.batch_size.observe(stats.num_seqs)
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_seconds.observe(seconds)

    def record_error(self, reason: str) -> None:
        self.errors.labels(reason=reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latencies of one engine request, observed as its outputs arrive on the event loop, from
    ``start`` (its ``time.monotonic()`` arrival).

    The first token is measured by TTFT; every later token is one ITL observation: the tokens of
    one delivery share the gap since the previous delivery evenly (the extra tokens of the first
    delivery arrived with the first one: gap 0). So the ITLs of a request sum to the time from
    its first token to its last, and TPOT is their mean.
    """

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self._metrics = metrics
        self._start = start
        self._first: float | None = None
        self._last: float | None = None
        self._num_tokens = 0

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        total = max(len(o.token_ids) for o in out.outputs)  # per sequence: n>1 decode in step
        new = total - self._num_tokens
        if new > 0:
            gap = 0.0
            if self._first is None:
                self._metrics.ttft.observe(now - self._start)
                self._first = now
                new -= 1
            else:
                gap = (now - self._last) / new
            for _ in range(new):
                self._metrics.itl.observe(gap)
            self._last = now
            self._num_tokens = total
        if out.finished:
            self._finish(out, now)

    def _finish(self, out: RequestOutput, now: float) -> None:
        m = self._metrics
        m.e2e.observe(now - self._start)
        longest = max(len(o.token_ids) for o in out.outputs)
        if self._first is not None and longest > 1:
            m.tpot.observe((now - self._first) / (longest - 1))
        m.success.labels(finish_reason=out.outputs[0].finish_reason or "abort").inc()
