"""Streamed hand-overs (``disaggregation.stream_kv``): what a prefill instance announces about a
request's KV while its prompt is being computed, and where the announcements wait to be read.

A prefill instance answers a streamed hand-over as soon as the request is admitted, with
``block_ids: []`` and ``stream: true``; from then on each ``KVAnnouncement`` of its transfer
lists the prefill blocks whose every token's KV is computed, in logical order, each list
extending the one before it::

    running   blocks 0 .. k-1 are final (k grows as prefill chunks complete)
    done      the prompt is computed; ``block_ids`` cover all ``num_tokens`` tokens
    failed    the prefill request ended early (aborted, preempted); read nothing more

Where the prefill instance's connector checksums blocks (``KVConnector.block_checksums``), each
announcement also carries the checksum of each of its blocks (``kv_checksums``, one per block id,
extending the previous announcement's like the ids do): the decode instance checks every block it
read against them before the request decodes, as it does for a whole hand-over.

The engine thread publishes to an ``AnnouncementBoard``; the server answers
``GET /kv/progress`` from it (``tandem.server.kv_progress``), signed under the cluster secret
(``tandem.handover_auth.announcement_signature``). The decode instance follows the announcements
and reads each new run of blocks as it appears (``tandem.kv_transfer``).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

CHECKSUM_HEX_DIGITS = 8
_HEX = frozenset("0123456789abcdef")
STATES = ("running", "done", "failed")
MAX_ENDED = 4096
"""Ended transfers whose last announcement is kept for late readers (the oldest go first)."""


@dataclass(slots=True, frozen=True)
class KVAnnouncement:
    """The prefill side's word on one streamed transfer (see the module docstring)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    state: str = "running"
    checksums: tuple[int, ...] = ()
    """One per block id, or none (the prefill instance's connector cannot checksum)."""

    def __post_init__(self) -> None:
        assert self.state in STATES, self.state
        assert not self.checksums or len(self.checksums) == len(self.block_ids)

    @property
    def ended(self) -> bool:
        return self.state != "running"

    def to_json(self) -> dict[str, Any]:
        body = {"transfer_id": self.transfer_id, "block_ids": list(self.block_ids), "state": self.state}
        if self.checksums:
            body["kv_checksums"] = format_checksums(self.checksums)
        return body

    @classmethod
    def from_json(cls, data: Any) -> KVAnnouncement:
        """Raises ValueError naming what is malformed."""
        if not isinstance(data, dict):
            raise ValueError("an announcement is a JSON object")
        block_ids, state = data.get("block_ids"), data.get("state")
        if not (isinstance(block_ids, list) and all(type(b) is int and b >= 0 for b in block_ids)):
            raise ValueError("announcement.block_ids must be a list of block ids")
        if state not in STATES or not isinstance(data.get("transfer_id"), str):
            raise ValueError(f"announcement.state must be one of {STATES}, with a transfer_id")
        checksums = parse_checksums(data.get("kv_checksums"), len(block_ids), "announcement.kv_checksums")
        return cls(data["transfer_id"], tuple(block_ids), state, checksums)


def format_checksums(checksums: Sequence[int]) -> list[str]:
    """Block checksums as hand-overs and announcements carry them: 8 lower-case hex digits each."""
    return [f"{c:0{CHECKSUM_HEX_DIGITS}x}" for c in checksums]


def parse_checksums(value: Any, num_blocks: int, field: str) -> tuple[int, ...]:
    """``format_checksums``' output read back: none (None or empty) or one per block; raises
    ValueError naming ``field`` otherwise."""
    if not value:
        return ()
    if not (isinstance(value, list) and len(value) == num_blocks and all(
            isinstance(c, str) and len(c) == CHECKSUM_HEX_DIGITS and set(c) <= _HEX for c in value)):
        raise ValueError(f"{field} must hold one {CHECKSUM_HEX_DIGITS}-digit hex checksum per block")
    return tuple(int(c, 16) for c in value)


class AnnouncementBoard:
    """The latest announcement of each streamed transfer of one prefill engine. Written by the
    engine thread, read by the server's event loop (thread-safe); running transfers are kept
    until they end, ended ones up to ``MAX_ENDED``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, KVAnnouncement] = {}
        self._ended: OrderedDict[str, KVAnnouncement] = OrderedDict()
        self._params: dict[str, dict[str, Any]] = {}

    def open(self, request_id: str, params: dict[str, Any]) -> None:
        """A streamed transfer starts: its hand-over ``params`` (unsigned) wait for the server
        (``take_params``), its first announcement lists no block."""
        with self._lock:
            self._params[request_id] = params
        self.publish(KVAnnouncement(params["transfer_id"], ()))

    def take_params(self, request_id: str) -> dict[str, Any] | None:
        """The hand-over of ``request_id``'s streamed transfer, once (None: it has none)."""
        with self._lock:
            return self._params.pop(request_id, None)

    def publish(self, announcement: KVAnnouncement) -> None:
        with self._lock:
            transfer_id = announcement.transfer_id
            if announcement.ended:
                self._latest.pop(transfer_id, None)
                self._ended[transfer_id] = announcement
                while len(self._ended) > MAX_ENDED:
                    self._ended.popitem(last=False)
            else:
                self._latest[transfer_id] = announcement

    def get(self, transfer_id: str) -> KVAnnouncement | None:
        with self._lock:
            return self._latest.get(transfer_id) or self._ended.get(transfer_id)
