"""Schema fuzzing for the server and router tests: schemathesis's engine (the runner behind
``st run``) with its coverage and fuzzing phases and the ``not_a_server_error`` check, from an
instance's own ``/openapi.json``, for a bounded time, plus a watch on ``/health`` meanwhile.

    fuzz(schema, base_url, seconds, seed, watch, headers=None) -> FuzzReport
    only_paths(schema, prefix)   the schema reduced to the paths under ``prefix``
    HealthWatch(urls)        polls each url's /health every 0.1 s in a thread; .failures
    fuzz_seconds(), fuzz_seed()   TANDEM_FUZZ_SECONDS (default 20), TANDEM_FUZZ_SEED (default random)

Generated requests are hostile in every field but their cost: a ``before_call`` hook lowers a
``max_tokens`` / ``max_completion_tokens`` above MAX_TOKENS to MAX_TOKENS (and sets ``max_tokens``
where a body leaves both unset or null, which means "up to the context length"), and an ``n``
above MAX_N to MAX_N.
Nothing else is changed or filtered: zero, negative, fractional, null and wrongly typed values of
those fields go out as generated. Every answer is counted through an ``after_call`` hook; every
5xx (and every request that got no answer) is kept with its body.
"""
from __future__ import annotations

import collections
import copy
import json
import os
import random
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from schemathesis.engine import Status, events, from_schema
from schemathesis.hooks import GLOBAL_HOOK_DISPATCHER

MAX_TOKENS = 8
MAX_N = 2
_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens")


def fuzz_seconds(default: int = 20) -> int:
    return int(os.environ.get("TANDEM_FUZZ_SECONDS", default))


def fuzz_seed() -> int:
    return int(os.environ.get("TANDEM_FUZZ_SEED", random.randrange(2**32)))


@dataclass(slots=True, frozen=True)
class ServerError:
    """A 5xx answer (``status``) or no answer at all (``status`` None)."""

    method: str
    path: str
    status: int | None
    body: Any
    answer: str

    def cause(self) -> str:
        """What tells one failure from another: the status and the error message."""
        try:
            message = json.loads(self.answer)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = self.answer[:200]
        return f"{self.status} {message}"

    def describe(self) -> str:
        return f"{self.method} {self.path} -> {self.cause()}\n    body: {_shown(self.body)[:1500]}"


@dataclass
class FuzzReport:
    seed: int
    seconds: float = 0.0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    server_errors: list[ServerError] = field(default_factory=list)
    shrunk: list[str] = field(default_factory=list)
    """schemathesis's own failure reports (title, message and a curl command to reproduce)."""
    stop_reason: str = ""
    fatal: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def num_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def summary(self, target: str) -> str:
        by_class: collections.Counter = collections.Counter()
        for status, n in self.statuses.items():
            by_class[f"{status // 100}xx"] += n
        return (f"schemathesis against {target}: {self.requests} requests in {self.seconds:.0f} s "
                f"(seed {self.seed}, stopped: {self.stop_reason}), {dict(sorted(by_class.items()))}, 5xx: {self.num_5xx}, "
                f"no answer: {sum(e.status is None for e in self.server_errors)}")

    def distinct_errors(self) -> str:
        """One line per distinct cause, with the smallest body that had it and how often it came."""
        causes: dict[str, list[ServerError]] = collections.defaultdict(list)
        for error in self.server_errors:
            causes[error.cause()].append(error)
        lines = []
        for cause, errors in causes.items():
            smallest = min(errors, key=lambda e: len(_shown(e.body)))
            lines.append(f"[{len(errors)}×] {smallest.describe()}")
        return "\n".join(lines + self.fatal + self.shrunk)


class HealthWatch:
    """Polls ``url/health`` of each url every ``interval_s`` until stopped; ``failures`` lists
    every answer other than 200 (and every poll that got none) as ``(url, what)``."""

    def __init__(self, urls: Iterable[str], interval_s: float = 0.1) -> None:
        self.urls = list(urls)
        self.interval_s = interval_s
        self.failures: list[tuple[str, str]] = []
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(timeout=10, trust_env=False) as client:
            while not self._stop.wait(self.interval_s):
                for url in self.urls:
                    self.polls += 1
                    try:
                        status = client.get(f"{url}/health").status_code
                    except httpx.TransportError as exc:
                        self.failures.append((url, f"no answer: {type(exc).__name__}"))
                        continue
                    if status != 200:
                        self.failures.append((url, f"/health answered {status}"))


def only_paths(schema: dict, prefix: str) -> dict:
    """``schema`` with only the paths that start with ``prefix`` (its components kept)."""
    return {**schema, "paths": {p: ops for p, ops in schema["paths"].items() if p.startswith(prefix)}}


def _cap_cost(context, case, kwargs) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    if all(body.get(name) is None for name in _LENGTH_FIELDS):
        body["max_tokens"] = MAX_TOKENS
    for name, cap in [*((f, MAX_TOKENS) for f in _LENGTH_FIELDS), ("n", MAX_N)]:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[name] = cap


def fuzz(schema: dict, base_url: str, seconds: int, seed: int, watch: HealthWatch | None = None,
         workers: int = 1, headers: dict[str, str] | None = None) -> FuzzReport:
    """Fuzz ``base_url`` with ``schema`` (an OpenAPI document) for ``seconds``, sending
    ``headers`` with every request; stops early once ``watch`` has seen a failure (the rest of
    the run would only count its consequences). One worker by default: a request that kills the
    engine fails every request in flight with it, and alone it is the one whose body is reported
    (concurrency is the soak test's part)."""
    report = FuzzReport(seed)
    config = schemathesis.Config.from_dict({
        "max-time": seconds, "seed": seed, "workers": workers, "request-timeout": 60, "base-url": base_url,
        "headers": headers or {},
        "checks": {"enabled": False, "not_a_server_error": {"enabled": True}},
        "output": {"sanitization": {"enabled": False}},  # "max_tokens" is no secret
        "phases": {"examples": {"enabled": False}, "coverage": {"enabled": True},
                   "fuzzing": {"enabled": True}, "stateful": {"enabled": False}},
    })
    loaded = schemathesis.openapi.from_dict(schema, config=config)
    lock = threading.Lock()

    @loaded.hook
    def after_call(context, case, response) -> None:
        with lock:
            report.statuses[response.status_code] += 1
            if response.status_code >= 500:
                report.server_errors.append(ServerError(case.method, case.formatted_path, response.status_code,
                                                        copy.deepcopy(case.body), response.text[:2000]))

    @loaded.hook
    def after_network_error(context, case, request) -> None:
        with lock:
            report.server_errors.append(ServerError(case.method, case.formatted_path, None,
                                                    copy.deepcopy(case.body), ""))

    schemathesis.hook("before_call")(_cap_cost)
    start = time.monotonic()
    try:
        stream = from_schema(loaded).execute()
        for event in stream:
            if watch is not None and watch.failures:
                stream.stop()
            _note(report, event)
    finally:
        GLOBAL_HOOK_DISPATCHER.unregister(_cap_cost)
        report.seconds = time.monotonic() - start
    return report


def _note(report: FuzzReport, event: events.EngineEvent) -> None:
    if isinstance(event, events.ScenarioFinished) and event.status == Status.FAILURE:
        for checks in event.recorder.checks.values():
            for check in checks:
                if check.status == Status.FAILURE and check.failure_info is not None:
                    failure = check.failure_info.failure
                    report.shrunk.append(f"schemathesis: {failure.title}: {failure.message}\n"
                                         f"    {check.failure_info.code_sample}")
    elif isinstance(event, (events.FatalError, events.NonFatalError)):
        error = event.exception if isinstance(event, events.FatalError) else event.value
        report.fatal.append(f"schemathesis error: {''.join(traceback.format_exception(error))[-3000:]}")
    elif isinstance(event, events.EngineFinished):
        report.stop_reason = str(event.stop_reason)


def _shown(body: Any) -> str:
    try:
        return json.dumps(body, ensure_ascii=True)
    except (TypeError, ValueError):
        return repr(body)
