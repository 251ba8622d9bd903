"""The router's instances: role, health, load, and the health checks that keep rotation true.

An instance is *in rotation* while it is healthy. Health changes in two places::

    health check, every interval_s         GET /health → 200: healthy (then GET /metrics → load)
                                                      → anything else, or no answer: unhealthy
    request path (dispatch.py)             503, or the instance cannot be reached: unhealthy now

so a dead instance leaves rotation at the first failed check or request, and comes back at the
first check it answers with 200. A new instance is unhealthy until its first check.

Roles (``tandem.config.Role``): a prefill step may use an instance of role prefill or both, a
decode step one of role decode or both. Everything here runs on the router's event loop; nothing blocks it.
"""
from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.config import Role
from tandem.interfaces import InstanceInfo

logger = logging.getLogger("tandem.router")



class Step(enum.StrEnum):
    """A step of a request through the router, each served by its own instances; the values are
    the ``step`` label of ``tandem:router_upstream_requests_total``."""

    PREFILL = "prefill"
    """Compute the prompt and hand its KV blocks over (prefill and colocated instances)."""
    DECODE = "decode"
    """Generate the tokens (decode and colocated instances)."""


_SERVES = {Step.PREFILL: (Role.PREFILL, Role.BOTH), Step.DECODE: (Role.DECODE, Role.BOTH)}

# The instance's /metrics gauges the load is read from (docs/metrics.md).
_LOAD_GAUGES = {
    "tandem:num_requests_waiting": "num_waiting",
    "tandem:num_requests_running": "num_running",
    "tandem:kv_cache_usage_perc": "kv_usage",
}


@dataclass(slots=True)
class InstanceState:
    """One instance as the router knows it. ``reason`` says why it is out of rotation."""

    url: str
    role: Role
    healthy: bool = False
    reason: str = "not checked yet"
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_in_flight: int = 0

    def info(self) -> InstanceInfo:
        return InstanceInfo(url=self.url, role=self.role, num_waiting=self.num_waiting,
                            num_running=self.num_running, kv_usage=self.kv_usage,
                            num_in_flight=self.num_in_flight)

    def as_dict(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "reason": None if self.healthy else self.reason, "num_waiting": self.num_waiting,
                "num_running": self.num_running, "kv_usage": self.kv_usage,
                "num_in_flight": self.num_in_flight}


@dataclass(slots=True, frozen=True)
class Load:
    num_waiting: int
    num_running: int
    kv_usage: float


def parse_load(metrics_text: str) -> Load | None:
    """The load gauges of an instance's Prometheus text; None when any of them is missing."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in _LOAD_GAUGES:
                values[_LOAD_GAUGES[sample.name]] = sample.value
    if len(values) < len(_LOAD_GAUGES):
        return None
    return Load(int(values["num_waiting"]), int(values["num_running"]), values["kv_usage"])


class DuplicateInstance(ValueError):
    """The URL is already registered."""


class InstanceRegistry:
    """The instances by URL, in the order they were added."""

    def __init__(self, instances: Sequence[tuple[str, Role | str]] = ()) -> None:
        self._instances: dict[str, InstanceState] = {}
        self.rotation_listeners: list[Callable[[str, bool], None]] = []
        """Called with (url, in rotation) whenever an instance enters or leaves rotation."""
        for url, role in instances:
            self.add(url, role)

    def add(self, url: str, role: Role | str) -> InstanceState:
        """A new instance, out of rotation until its first health check; ``ValueError`` when
        the role is unknown or the URL not one httpx can send to, ``DuplicateInstance`` when it
        is already registered."""
        try:
            role = Role(role)
        except ValueError:
            raise ValueError(f"unknown role {role!r}; roles: {', '.join(Role)}") from None
        _check_url(url)
        if url in self._instances:
            raise DuplicateInstance(f"the instance {url} is already registered")
        state = self._instances[url] = InstanceState(url, role)
        logger.info("instance %s (%s) added", url, role)
        return state

    def remove(self, url: str) -> InstanceState:
        """Take ``url`` out for good (``KeyError`` when unknown); requests in flight finish."""
        state = self._instances.pop(url)
        logger.info("instance %s (%s) removed", url, state.role)
        if state.healthy:
            self._rotation_changed(url, False)
        return state

    def get(self, url: str) -> InstanceState | None:
        return self._instances.get(url)

    def all(self) -> list[InstanceState]:
        return list(self._instances.values())

    def has_role(self, role: Role) -> bool:
        """Whether any registered instance, healthy or not, has exactly ``role``."""
        return any(s.role == role for s in self._instances.values())

    def candidates(self, step: Step, exclude: Collection[str] = ()) -> list[InstanceInfo]:
        """Healthy instances that can serve ``step``, except ``exclude``."""
        roles = _SERVES[step]
        return [s.info() for s in self._instances.values()
                if s.healthy and s.role in roles and s.url not in exclude]

    def mark_down(self, url: str, reason: str) -> None:
        """Take ``url`` out of rotation until a health check brings it back."""
        state = self._instances.get(url)
        if state is not None and state.healthy:
            logger.warning("instance %s leaves rotation: %s", url, reason)
            state.healthy, state.reason = False, reason
            self._rotation_changed(url, False)

    @contextmanager
    def in_flight(self, url: str) -> Iterator[None]:
        """Count one request on ``url`` for as long as the block runs."""
        state = self._instances.get(url)
        if state is not None:
            state.num_in_flight += 1
        try:
            yield
        finally:
            if state is not None:
                state.num_in_flight -= 1

    # ----------------------------------------------------------------------- health checks

    async def check(self, state: InstanceState, client: httpx.AsyncClient) -> None:
        """One health check of ``state``: /health, then /metrics for its load."""
        try:
            health = await client.get(f"{state.url}/health")
        except Exception as exc:  # noqa: BLE001 — whatever fails, the checks of the others go on
            self._set_health(state, False, f"health check failed: {type(exc).__name__}: {exc}")
            return
        if health.status_code != 200:
            self._set_health(state, False, f"/health answered {health.status_code}")
            return
        try:
            metrics = await client.get(f"{state.url}/metrics")
            load = parse_load(metrics.text) if metrics.status_code == 200 else None
        except Exception as exc:  # noqa: BLE001 — a bad /metrics must not stop the health checks
            logger.debug("instance %s: no load from /metrics: %s", state.url, exc)
            load = None
        if load is not None:
            state.num_waiting, state.num_running, state.kv_usage = (
                load.num_waiting, load.num_running, load.kv_usage)
        self._set_health(state, True, "")

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(s, client) for s in self.all()))

    async def run_checks(self, client: httpx.AsyncClient, interval_s: float) -> None:
        """Check every instance every ``interval_s`` seconds, forever (cancel to stop)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all(client)

    def _set_health(self, state: InstanceState, healthy: bool, reason: str) -> None:
        changed = healthy != state.healthy
        if healthy and not state.healthy:
            logger.info("instance %s (%s) is in rotation", state.url, state.role)
        elif not healthy and state.healthy:
            logger.warning("instance %s leaves rotation: %s", state.url, reason)
        state.healthy, state.reason = healthy, reason
        if changed and state.url in self._instances:
            self._rotation_changed(state.url, healthy)

    def _rotation_changed(self, url: str, in_rotation: bool) -> None:
        for listener in self.rotation_listeners:
            listener(url, in_rotation)


def _check_url(url: str) -> None:
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{url!r} is not a URL the router can send to: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not a URL the router can send to: it needs http:// or https:// and a host")
