"""The "faulty" KV connector: another connector (``fault_injection.inner_connector``) with faults
injected into a seeded fraction of its reads and notifications — for tests and chaos runs, never
for serving. It wraps any ``KVConnector`` through the interface alone, so the hand-over paths
built on it (delta reads, mixed parallelism, streaming) meet the same faults.

Faults, each decided in call order by a generator seeded from ``seed + rank`` — reads' faults by
one of their own, so the n-th read's fault does not depend on how many notifications came
before it — logged and counted (``event_counts``, by the names below)::

    reader side  read_fail      the read runs, then is reported "error:transfer"
                 read_delay     "done" is reported up to read_delay_s late (uniformly); past
                 read_late      the transfer's deadline: "error:deadline" at once, "closed" then
                 truncate       "done", with the second half of the read's last local block
                                overwritten (as if those bytes never arrived): only the block
                                checksums can tell
                 notify_drop    a release without a read (``notify_release``) never sent
    owner side   notify_drop    a reader's notification lost: the pin waits for its expiry
                 notify_delay   a notification held back notify_delay_s
                 restart        after every restart_every_n-th notification the inner connector
                                is closed and a new one registers the same pool: a new agent
                                with new metadata behind the same handshake URL; readers'
                                cached handshakes are stale from then on

A read that ends in anything but "done" is passed through untouched. Only reads of at least one
block are faulted.
"""
from __future__ import annotations

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tandem.interfaces import KVConnector, KVPoolDescriptor, KVReadCounters

logger = logging.getLogger("tandem.transport")

GARBAGE_BYTE = 0x5A


@dataclass(slots=True)
class _Fault:
    kind: str
    local_block_ids: list[int]
    deadline: float


@dataclass(slots=True)
class _Held:
    report_at: float
    state: str


class FaultyConnector(KVConnector):
    """Built with no arguments; ``configure`` (before ``register_pool``) reads
    ``config.fault_injection`` and builds the inner connector from the plugin registry."""

    name = "faulty"

    def __init__(self) -> None:
        self._config: Any = None
        self._settings: Any = None
        self._inner: KVConnector | None = None
        self._rng = random.Random(0)
        self._read_rng = random.Random(0)
        self._pool: Any = None
        self._descriptor: KVPoolDescriptor | None = None
        self._bytes: Any = None
        self._faults: dict[str, _Fault] = {}
        self._held: dict[str, _Held] = {}
        self._held_notifications: list[tuple[float, str]] = []
        self._heard = 0
        self._counts: Counter[str] = Counter()

    # ------------------------------------------------------------------ set-up

    def configure(self, config: Any) -> None:
        self._config, self._settings = config, config.fault_injection
        self._seed(self._settings.seed)
        self._inner = self._new_inner()

    def register_pool(self, pool: Any, descriptor: KVPoolDescriptor) -> None:
        if self._inner is None:
            raise RuntimeError('the "faulty" connector needs configure(config) before register_pool')
        self._inner.register_pool(pool, descriptor)
        self._pool, self._descriptor = pool, descriptor
        self._bytes = pool.view(-1).view(_uint8()).view(descriptor.num_blocks, descriptor.block_bytes)
        self._seed(self._settings.seed + descriptor.rank)

    def _seed(self, seed: int) -> None:
        self._rng, self._read_rng = random.Random(seed), random.Random(f"reads {seed}")

    def handshake_info(self) -> dict[str, Any]:
        return self._inner.handshake_info()

    def add_peer(self, handshake: dict[str, Any]) -> str:
        return self._inner.add_peer(handshake)

    def remove_peer(self, peer: str) -> None:
        self._inner.remove_peer(peer)

    # ------------------------------------------------------------------ reader side

    def start_read(self, transfer_id: str, peer: str, remote_block_ids: list[int],
                   local_block_ids: list[int], deadline_s: float) -> None:
        self._inner.start_read(transfer_id, peer, remote_block_ids, local_block_ids, deadline_s)
        if not local_block_ids:
            return
        s, draw = self._settings, self._read_rng.random()
        for kind, rate in (("read_fail", s.read_fail_rate), ("read_delay", s.read_delay_rate),
                           ("truncate", s.truncate_rate)):
            if draw < rate:
                self._faults[transfer_id] = _Fault(kind, list(local_block_ids), time.monotonic() + deadline_s)
                return
            draw -= rate

    def poll(self) -> dict[str, str]:
        changed = {}
        for transfer_id, state in self._inner.poll().items():
            fault = self._faults.pop(transfer_id, None)
            changed[transfer_id] = self._inject(transfer_id, fault, state) if fault and state == "done" else state
        now = time.monotonic()
        for transfer_id, held in list(self._held.items()):
            if now >= held.report_at:
                del self._held[transfer_id]
                changed[transfer_id] = held.state
        return {tid: state for tid, state in changed.items() if state is not None}

    def _inject(self, transfer_id: str, fault: _Fault, state: str) -> str | None:
        """The state reported for ``transfer_id``'s read, which ended "done"; None: not yet."""
        if fault.kind == "read_fail":
            self._count("read_fail", transfer_id)
            return "error:transfer"
        if fault.kind == "truncate":
            block = self._bytes[fault.local_block_ids[-1]]
            block[block.shape[0] // 2:] = GARBAGE_BYTE
            self._count("truncate", transfer_id)
            return state
        report_at = time.monotonic() + self._rng.uniform(0.0, self._settings.read_delay_s)
        if report_at < fault.deadline:
            self._count("read_delay", transfer_id)
            self._held[transfer_id] = _Held(report_at, state)
            return None
        self._count("read_late", transfer_id)
        self._held[transfer_id] = _Held(report_at, "closed")
        return "error:deadline"

    def notify_release(self, peer: str, transfer_id: str) -> None:
        if self._rng.random() < self._settings.notify_drop_rate:
            self._count("notify_drop", transfer_id)
            return
        self._inner.notify_release(peer, transfer_id)

    def read_counters(self) -> list[KVReadCounters]:
        return self._inner.read_counters()

    def block_checksums(self, block_ids: list[int]) -> list[int] | None:
        return self._inner.block_checksums(block_ids)

    # ------------------------------------------------------------------ owner side

    def get_notifications(self) -> list[str]:
        s, now = self._settings, time.monotonic()
        ready = [tid for at, tid in self._held_notifications if at <= now]
        self._held_notifications = [(at, tid) for at, tid in self._held_notifications if at > now]
        heard = self._inner.get_notifications()
        for transfer_id in heard:
            draw = self._rng.random()
            if draw < s.notify_drop_rate:
                self._count("notify_drop", transfer_id)
            elif draw < s.notify_drop_rate + s.notify_delay_rate:
                self._count("notify_delay", transfer_id)
                self._held_notifications.append((now + s.notify_delay_s, transfer_id))
            else:
                ready.append(transfer_id)
        self._heard += len(heard)
        if s.restart_every_n and self._heard >= s.restart_every_n:
            self._heard = 0
            self._restart()
        return ready

    def _restart(self) -> None:
        """A new inner connector (a new agent) registers the pool; then the old one closes. The
        handshake served from then on is the new one's."""
        fresh = self._new_inner()
        try:
            fresh.register_pool(self._pool, self._descriptor)
        except Exception:  # noqa: BLE001 — a restart that fails leaves the old agent serving
            logger.exception("fault injection: the restarted KV connector could not register the pool")
            fresh.close()
            return
        old, self._inner = self._inner, fresh
        old.close()
        self._count("restart", fresh.handshake_info().get("agent_name", "?"))

    # ------------------------------------------------------------------ the rest

    def event_counts(self) -> dict[str, int]:
        return {**self._inner.event_counts(), **self._counts} if self._inner is not None else dict(self._counts)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()

    def _new_inner(self) -> KVConnector:
        from tandem.plugin_manager import get_registry

        inner = get_registry().get("kv_connector", self._settings.inner_connector)()
        inner.configure(self._config)
        return inner

    def _count(self, kind: str, what: str) -> None:
        self._counts[kind] += 1
        logger.warning("fault injected: %s (%s)", kind, what)


def _uint8() -> Any:
    import torch

    return torch.uint8
