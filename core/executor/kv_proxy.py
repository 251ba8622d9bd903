"""Disaggregation under tensor and pipeline parallelism: one ``KVConnector`` in the engine
process that stands for every rank's.

Each rank's worker registers its slice of the KV pool (its stage's layers, its KV heads: its
``KVShard``, with every rank's in the descriptor) with a connector of its own; block ids are the
same on every rank. ``RankedConnector`` forwards each call to every rank (through the
executor's channel: ``call_ranks``) and merges the answers::

    handshake_info   rank 0's fields, plus "ranks" (every rank's handshake) and the parallel
                     sizes; asked of the ranks again at most every ``HANDSHAKE_REFRESH_S``, on
                     the engine thread (``get_notifications``): a rank's transport may restart
                     with a new agent
    add_peer         every rank gets the peer's whole handshake and reads the layers and heads
                     of its shard from the peer's ranks that hold them
                     (``tandem.transport.shard_plan``): the peer may be split another way
    start_read       every rank reads its share of the blocks ("error:peer" at the next poll for
                     a peer not added, or removed since: as a rank's own connector reports it)
    poll             a transfer is "done" once every rank's read is; "error:<reason>" once every
                     rank's read ended and one failed ("error:deadline" when any rank's ran past
                     its deadline, then "closed" once each of those is closed)
    get_notifications  a transfer id once each rank's connector has heard from all its readers
    read_counters    every rank's, in rank order
    block_checksums  the ranks' shares added (``tandem.transport.kv_checksum``); None when a
                     rank cannot checksum
    event_counts     summed over the ranks
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

from tandem.interfaces import KVConnector, KVReadCounters

DONE, DEADLINE, CLOSED = "done", "error:deadline", "closed"
MAX_PARTIAL_NOTIFICATIONS = 65536
CHECKSUM_MASK = (1 << 32) - 1
HANDSHAKE_REFRESH_S = 1.0


class RankedConnector(KVConnector):
    """Built by the mp executor once its ranks registered their pools (``handshakes``: each
    rank's ``handshake_info``). ``call_ranks(method, per_rank_args)`` runs
    ``connector.method(*args)`` on rank r for every r and returns their results in rank order."""

    name = "ranked"

    def __init__(self, call_ranks: Callable[[str, list[tuple]], list[Any]], handshakes: list[dict[str, Any]],
                 tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
        self._call = call_ranks
        self.world_size = len(handshakes)
        self._sizes = {"tensor_parallel_size": tensor_parallel_size,
                       "pipeline_parallel_size": pipeline_parallel_size}
        self._handshake = self._merged(handshakes)
        self._handshake_at = time.monotonic()
        self._peers: dict[str, list[str]] = {}
        self._ended: dict[str, dict[int, str]] = {}
        """Transfers in flight: rank → the first state it reported."""
        self._closing: dict[str, set[int]] = {}
        """Transfers reported "error:deadline": the ranks whose read is not closed yet."""
        self._notified: Counter[str] = Counter()
        self._unknown_peer: list[str] = []
        """Reads started on a peer not (or no longer) added: "error:peer" at the next poll."""

    def register_pool(self, pool: Any, descriptor: Any) -> None:
        raise RuntimeError("the ranks register their own pools (MultiprocExecutor.connect_kv)")

    def handshake_info(self) -> dict[str, Any]:
        return dict(self._handshake)

    def _merged(self, handshakes: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(handshakes[0]) | {"ranks": handshakes} | self._sizes

    def _refresh_handshake(self) -> None:
        now = time.monotonic()
        if now - self._handshake_at < HANDSHAKE_REFRESH_S:
            return
        self._handshake_at = now
        handshakes = self._call("handshake_info", [()] * self.world_size)
        if handshakes != self._handshake["ranks"]:
            self._handshake = self._merged(handshakes)  # one reference swap: other threads read it

    def add_peer(self, handshake: dict[str, Any]) -> str:
        names = self._call("add_peer", [(handshake,)] * self.world_size)
        self._peers[names[0]] = names
        return names[0]

    def start_read(self, transfer_id: str, peer: str, remote_block_ids: list[int],
                   local_block_ids: list[int], deadline_s: float) -> None:
        names = self._peers.get(peer)
        if names is None:  # removed since the read was planned: as a rank's connector reports it
            self._unknown_peer.append(transfer_id)
            return
        self._call("start_read", [(transfer_id, name, remote_block_ids, local_block_ids, deadline_s)
                                  for name in names])
        self._ended[transfer_id] = {}

    def poll(self) -> dict[str, str]:
        changed: dict[str, str] = dict.fromkeys(self._unknown_peer, "error:peer")
        self._unknown_peer.clear()
        for rank, states in enumerate(self._call("poll", [()] * self.world_size)):
            for tid, state in states.items():
                if tid in self._closing:
                    if state == CLOSED:
                        self._closing[tid].discard(rank)
                        if not self._closing[tid]:
                            del self._closing[tid]
                            changed[tid] = CLOSED
                elif tid in self._ended:
                    self._ended[tid].setdefault(rank, state)
        for tid, ended in list(self._ended.items()):
            if len(ended) < self.world_size:
                continue
            del self._ended[tid]
            states = set(ended.values())
            if states == {DONE}:
                changed[tid] = DONE
            elif DEADLINE in states:
                late = {rank for rank, state in ended.items() if state == DEADLINE}
                self._closing[tid] = late
                changed[tid] = DEADLINE
            else:
                changed[tid] = next(state for state in ended.values() if state != DONE)
        return changed

    def get_notifications(self) -> list[str]:
        self._refresh_handshake()
        ready = []
        for ids in self._call("get_notifications", [()] * self.world_size):
            for tid in ids:
                self._notified[tid] += 1
                if self._notified[tid] == self.world_size:
                    del self._notified[tid]
                    ready.append(tid)
        while len(self._notified) > MAX_PARTIAL_NOTIFICATIONS:  # readers that died half-way
            del self._notified[next(iter(self._notified))]
        return ready

    def read_counters(self) -> list[KVReadCounters]:
        return [c for counters in self._call("read_counters", [()] * self.world_size) for c in counters]

    def block_checksums(self, block_ids: list[int]) -> list[int] | None:
        shares = self._call("block_checksums", [(block_ids,)] * self.world_size)
        if any(share is None for share in shares):
            return None
        return [sum(column) & CHECKSUM_MASK for column in zip(*shares, strict=True)]

    def event_counts(self) -> dict[str, int]:
        try:
            counts = self._call("event_counts", [()] * self.world_size)
        except Exception:  # noqa: BLE001 - never raises, as the contract says
            return {}
        total: Counter[str] = Counter()
        for rank_counts in counts:
            total.update(rank_counts)
        return dict(total)

    def notify_release(self, peer: str, transfer_id: str) -> None:
        names = self._peers.get(peer)
        if names is None:
            return
        try:
            self._call("notify_release", [(name, transfer_id) for name in names])
        except Exception:  # noqa: BLE001 - never raises, as the contract says
            pass

    def remove_peer(self, peer: str) -> None:
        names = self._peers.pop(peer, None)
        if names is None:
            return
        try:
            self._call("remove_peer", [(name,) for name in names])
        except Exception:  # noqa: BLE001 - never raises
            pass

    def close(self) -> None:
        """The ranks close their own connectors when the executor stops them."""
