"""Transfer notifications that count their readers.

Under mixed parallelism several reading ranks may read from one owner rank (a tp=1 prefill
instance read by both ranks of a tp=2 decode instance): the owner may free a transfer's blocks
only once all of them are done. Each notification says how many the owner rank gets for that
transfer in all (``tandem.transport.shard_plan.RankPlan.notify``)::

    "<transfer_id>#<count>"        e.g. "3f2a.../cmpl-7#2": one of 2 readers is done

``NotificationTally`` (owner side) yields a transfer id once ``count`` notifications of it have
arrived; a message without a count suffix counts as a whole (count 1).
"""
from __future__ import annotations

from collections import OrderedDict

MAX_PARTIAL = 65536
"""Transfers heard from some but not all readers that are remembered (readers that died half-way
leave theirs behind; the oldest go first)."""
MAX_COUNT = 1 << 16


def encode(transfer_id: str, count: int) -> bytes:
    assert 1 <= count <= MAX_COUNT, count
    return f"{transfer_id}#{count}".encode()


class NotificationTally:
    """Counts notifications per transfer id; ``add`` returns the ids now complete."""

    def __init__(self) -> None:
        self._heard: OrderedDict[str, int] = OrderedDict()

    def add(self, messages: list[bytes | str]) -> list[str]:
        complete = []
        for message in messages:
            text = message.decode(errors="replace") if isinstance(message, bytes) else message
            transfer_id, count = _decode(text)
            heard = self._heard.pop(transfer_id, 0) + 1
            if heard >= count:
                complete.append(transfer_id)
            else:
                self._heard[transfer_id] = heard
        while len(self._heard) > MAX_PARTIAL:
            self._heard.popitem(last=False)
        return complete


def _decode(text: str) -> tuple[str, int]:
    transfer_id, sep, count = text.rpartition("#")
    if sep and count.isascii() and count.isdigit() and 1 <= int(count) <= MAX_COUNT:
        return transfer_id, int(count)
    return text, 1
