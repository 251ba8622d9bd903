"""The instance's KV event publisher: one ``KVEventBatch`` per engine step that changed the prefix
cache, on a ZMQ PUB socket, with a ROUTER socket that replays recent batches to late subscribers.

Frames (vLLM's layout)::

    PUB      [topic, seq, payload]             seq: 8-byte big-endian, 0, 1, 2, ... per publisher
    replay   client → [b"", start]             start: 8-byte big-endian sequence number
             ROUTER → [b"", topic, seq, payload] for each buffered batch with seq >= start
             ROUTER → [b"", b"", END_SEQ, b""]  END_SEQ: -1 as 8-byte big-endian signed

Contract: ``publish`` is called by the engine thread and never blocks — it numbers the batch and
puts it on a bounded queue; a full queue drops the batch, and the missing number is how
subscribers learn they missed something. Encoding, sending and replies run on the publisher's own
thread, which owns both sockets after start-up. Both sockets bind (``tcp://host:0`` takes a free
port; ``endpoint`` and ``replay_endpoint`` report what was bound).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from tandem.kv_events.wire import BatchEncoder
from tandem.sched.kv_events import KVCacheEvent

logger = logging.getLogger("tandem.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@dataclass(slots=True, frozen=True)
class PublisherSettings:
    """What the publisher needs from ``[kv_events]`` (see ``tandem.config.KVEventsConfig``)."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    buffer_steps: int
    hwm: int
    max_queue_size: int
    medium: str


class KVEventPublisher:
    def __init__(self, settings: PublisherSettings, data_parallel_rank: int = 0) -> None:
        self.settings = settings
        self._topic = settings.topic.encode()
        self._encoder = BatchEncoder(settings.medium, data_parallel_rank)
        self._queue: queue.Queue[tuple[int, float, Sequence[KVCacheEvent]]] = queue.Queue(settings.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._next_seq = 0
        self.num_dropped_batches = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self.endpoint = _bind(self._pub, settings.endpoint)
            if settings.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._replay, settings.replay_endpoint)
        except OSError:
            self._ctx.destroy(linger=0)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events on %s (replay: %s, topic %r)", self.endpoint, self.replay_endpoint,
                    settings.topic)

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queue one step's events (engine thread; never blocks, see the module docstring)."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.num_dropped_batches += 1
            if self.num_dropped_batches == 1:
                logger.warning("KV events: the publisher's queue (kv_events.max_queue_size) is full; "
                               "batches are dropped and subscribers see a sequence gap")

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets (idempotent)."""
        self._stop.set()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                seq, ts, events = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                payload = self._encoder.encode(ts, events)
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            except Exception:  # noqa: BLE001 - one bad batch must not stop the publisher
                logger.exception("KV events: batch %d could not be published", seq)
                continue
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored (expected "
                           "[b'', 8-byte start])", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint``; the address bound (a port 0 replaced by the one the system chose)."""
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        raise OSError(f"cannot bind {endpoint}: {exc}") from None
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)
