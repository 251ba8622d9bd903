"""The consumer side of one instance's KV events: a SUB socket on its publisher plus replay
requests to its ROUTER socket, on a thread of its own, handing each batch to a sink in sequence
order.

Each batch is applied once and in order; the stream's states::

    start ──replay from 0──> LIVE ──seq == next──> LIVE (batch applied)
                              │
                              └──seq > next (a gap)──> replay from next ──> LIVE

A replay that cannot fill a gap (the publisher's buffer moved on, no replay socket, no answer in
``replay_timeout_s``), or a batch that does not decode, makes the sink forget everything it had
from this instance (``sink.reset``), and the stream goes on from the batches it has. Live
batches older than ``next`` (already had from a replay) are skipped, except seq 0: the publisher
restarted (reset, then applied). The router closes a stream when its instance leaves rotation and
opens a new one when it comes back (a restarted instance may have bound other ports).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq

from tandem.kv_events.publisher import END_SEQ, seq_bytes
from tandem.kv_events.wire import KVEventBatch, decode_batch

logger = logging.getLogger("tandem.kv_events")

_POLL_MS = 100


class EventSink(Protocol):
    """Where a stream's batches go; called on the stream's thread."""

    def apply(self, source: str, batch: KVEventBatch) -> None: ...

    def reset(self, source: str) -> None: ...


@dataclass(slots=True, frozen=True)
class StreamAddress:
    """One publisher: its PUB and replay endpoints (as bound) and topic."""

    endpoint: str
    replay_endpoint: str | None
    topic: str


class EventStream:
    """Subscribes ``source``'s publisher (found by ``locate``, retried until it answers) and
    feeds ``sink``. ``locate`` may block; it runs on the stream's thread."""

    def __init__(self, source: str, locate: Callable[[], StreamAddress | None], sink: EventSink,
                 replay_timeout_s: float = 2.0, retry_s: float = 1.0) -> None:
        self.source = source
        self._locate = locate
        self._sink = sink
        self.replay_timeout_s = replay_timeout_s
        self.retry_s = retry_s
        self._next: int | None = None
        self._stop = threading.Event()
        self.num_gaps = 0
        self.num_applied = 0
        self._thread = threading.Thread(target=self._run, name=f"tandem-kv-events-{source}", daemon=True)
        self._thread.start()

    def close(self, wait: bool = True) -> None:
        """Stop the thread (``wait``: and wait for it, up to 2 s); its sockets close with it."""
        self._stop.set()
        if wait:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        address = None
        while address is None and not self._stop.is_set():
            try:
                address = self._locate()
            except Exception as exc:  # noqa: BLE001 - the instance may not be up yet
                logger.debug("KV events of %s not located: %s", self.source, exc)
            if address is None:
                self._stop.wait(self.retry_s)
        if address is None:
            return
        ctx = zmq.Context()
        try:
            self._follow(ctx, address)
        except Exception:  # noqa: BLE001 - a broken stream must not kill the router
            logger.exception("KV events of %s: the subscriber stopped", self.source)
            self._sink.reset(self.source)
        finally:
            ctx.destroy(linger=0)

    def _follow(self, ctx: zmq.Context, address: StreamAddress) -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, address.topic.encode())
        sub.connect(address.endpoint)
        logger.info("KV events of %s: subscribed to %s", self.source, address.endpoint)
        self._replay(ctx, address, 0)
        while not self._stop.is_set():
            if not sub.poll(_POLL_MS):
                continue
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            seq = int.from_bytes(frames[1], "big")
            if self._next is not None and seq > self._next:
                self.num_gaps += 1
                logger.warning("KV events of %s: batches %d..%d missed; replaying", self.source,
                               self._next, seq - 1)
                self._replay(ctx, address, self._next)
            self._take(seq, frames[2])

    def _take(self, seq: int, payload: bytes) -> None:
        if seq == 0 and self._next:
            logger.info("KV events of %s: the publisher restarted", self.source)
            self._sink.reset(self.source)
            self._next = None
        if self._next is not None and seq < self._next:
            return
        if self._next is not None and seq > self._next:
            logger.warning("KV events of %s: batches %d..%d are lost; its entries are dropped",
                           self.source, self._next, seq - 1)
            self._sink.reset(self.source)
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            logger.warning("KV events of %s: batch %d is not a KVEventBatch (%s); its entries are "
                           "dropped", self.source, seq, exc)
            self._sink.reset(self.source)
        else:
            self._sink.apply(self.source, batch)
            self.num_applied += 1
        self._next = seq + 1

    def _replay(self, ctx: zmq.Context, address: StreamAddress, start: int) -> None:
        """Apply the publisher's buffered batches from ``start`` on (see the module docstring)."""
        if address.replay_endpoint is None:
            return
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(address.replay_endpoint)
            dealer.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + self.replay_timeout_s
            while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                if not dealer.poll(left_ms):
                    break
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    continue
                if frames[2] == END_SEQ:
                    return
                self._take(int.from_bytes(frames[2], "big"), frames[3])
            logger.warning("KV events of %s: no replay from %s within %.1f s", self.source,
                           address.replay_endpoint, self.replay_timeout_s)
        finally:
            dealer.close(linger=0)
