"""The prefill side of one engine's KV hand-overs: the blocks pinned for decode instances and, for
streamed hand-overs (``disaggregation.stream_kv``), what is announced of them while the prompt is
computed. Driven by ``tandem.kv_transfer.KVTransferCoordinator`` on the engine thread; the flow,
drawn: docs/architecture.md §2.

A pin is PINNED until its reader notifies (read, or will not read), the router gives the
hand-over up, or ``expiry_s`` passes (``tandem.handover``). A streamed transfer is announced on
``board`` from admission to its pin; a reader that gives it up before the pin exists (the router,
or the decode instance) has the pin released as soon as it is made.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tandem import handover
from tandem.handover import PrefillHandover
from tandem.handover_auth import prompt_digest
from tandem.kv_stream import AnnouncementBoard, KVAnnouncement
from tandem.sched.scheduler import PinnedKV, Scheduler

logger = logging.getLogger("tandem")


class PrefillPins:
    """Pins and streamed transfers of one prefill engine (see the module docstring); the
    coordinator's arguments of the same names."""

    def __init__(self, scheduler: Scheduler, *, engine_id: str, compat_hash: str, expiry_s: float,
                 secret: bytes | None, clock: Callable[[], float], wall_clock: Callable[[], float]) -> None:
        self.scheduler = scheduler
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.expiry_s = expiry_s
        self.secret = secret
        self._clock = clock
        self._wall_clock = wall_clock
        self._pins: dict[str, PrefillHandover] = {}  # PINNED, by transfer id
        self._streams: dict[str, int] = {}  # streamed transfer id → blocks announced
        self._unwanted: set[str] = set()  # streamed transfers their reader gave up before the pin
        self.board = AnnouncementBoard()

    @property
    def num_pins(self) -> int:
        return len(self._pins)

    @property
    def num_pinned_blocks(self) -> int:
        return sum(p.num_blocks for p in self._pins.values())

    def transfer_id(self, request_id: str) -> str:
        return f"{self.engine_id}/{request_id}"

    def on_new_pins(self, pins: list[PinnedKV]) -> dict[str, dict[str, Any]]:
        """PINNED for each of the scheduler's new pins (a streamed one's last announcement:
        ``done``, or ``failed`` for one that ended early); returns each complete pin's
        ``kv_transfer_params`` (without ``handshake_url`` and ``signature``, which the server
        adds). ``expires_at`` is in whole Unix seconds, no later than the pin's expiry: a decode
        instance refuses the hand-over before its blocks can be handed to another request."""
        params = {}
        expires_at = self._clock() + self.expiry_s
        for pin in pins:
            transfer_id = self.transfer_id(pin.request_id)
            if transfer_id in self._streams:
                del self._streams[transfer_id]
                self.board.take_params(pin.request_id)
                self.board.publish(KVAnnouncement(transfer_id, tuple(pin.block_ids) if pin.complete else (),
                                                  "done" if pin.complete else "failed"))
            self._pins[transfer_id] = PrefillHandover(transfer_id, pin.pin_id, len(pin.block_ids), expires_at)
            if transfer_id in self._unwanted or not pin.block_ids:
                self._unwanted.discard(transfer_id)
                self.release(transfer_id)
            elif pin.complete:
                params[pin.request_id] = self._hand_over(pin.request_id, pin.token_ids, pin.cache_salt,
                                                         list(pin.block_ids))
        return params

    def open_stream(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """A streamed hand-over for ``request_id`` (about to be added with ``RemoteKV.STREAM``):
        its ``kv_transfer_params`` (``block_ids: []``, ``stream: true``) wait on the board for the
        server (``AnnouncementBoard.take_params``), and its first announcement lists no block."""
        self._streams[self.transfer_id(request_id)] = 0
        self.board.open(request_id, self._hand_over(request_id, token_ids, cache_salt, []) | {"stream": True})

    def announce(self, progress: list[tuple[str, list[int]]]) -> None:
        """Publish the blocks of streamed transfers that became final (``Scheduler.stream_progress``)."""
        for request_id, block_ids in progress:
            transfer_id = self.transfer_id(request_id)
            if len(block_ids) > self._streams.get(transfer_id, len(block_ids)):
                self._streams[transfer_id] = len(block_ids)
                self.board.publish(KVAnnouncement(transfer_id, tuple(block_ids)))

    def forget_stream(self, request_id: str) -> None:
        """A streamed transfer whose request never made it into the scheduler (refused at
        admission): announced ``failed``, nothing pinned."""
        transfer_id = self.transfer_id(request_id)
        if transfer_id in self._streams and self.scheduler.get_request(request_id) is None:
            del self._streams[transfer_id]
            self._unwanted.discard(transfer_id)
            self.board.take_params(request_id)
            self.board.publish(KVAnnouncement(transfer_id, (), "failed"))

    def release(self, transfer_id: str) -> bool:
        """Release the pin of ``transfer_id`` now: no decode instance will read it (the router
        gave the hand-over up). A streamed transfer still computing is released once pinned.
        False when there is no such pin or stream; a pin is released once, so a later
        notification or expiry of it finds nothing."""
        pin = self._pins.pop(transfer_id, None)
        if pin is None:
            return self._give_up_stream(transfer_id)
        logger.info("KV blocks of %s released unread: the hand-over was given up", transfer_id)
        handover.release(pin)
        self.scheduler.release_blocks(pin.pin_id)
        return True

    def on_notified(self, transfer_ids: Iterable[str]) -> None:
        """The readers of ``transfer_ids`` are done with them (the connector's notifications)."""
        for transfer_id in transfer_ids:
            pin = self._pins.pop(transfer_id, None)
            if pin is not None:
                handover.release(pin)
                self.scheduler.release_blocks(pin.pin_id)
            else:
                self._give_up_stream(transfer_id)

    def expire(self) -> int:
        """EXPIRED for each pin past ``expiry_s``; returns how many."""
        now, expired = self._clock(), 0
        for transfer_id, pin in list(self._pins.items()):
            if now >= pin.expires_at:
                logger.info("KV blocks of %s expired unclaimed after %.0f s", transfer_id, self.expiry_s)
                del self._pins[transfer_id]
                handover.expire(pin)
                self.scheduler.release_blocks(pin.pin_id)
                expired += 1
        return expired

    def _give_up_stream(self, transfer_id: str) -> bool:
        if transfer_id not in self._streams:
            return False
        self._unwanted.add(transfer_id)
        return True

    def _hand_over(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None,
                   block_ids: list[int]) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "transfer_id": self.transfer_id(request_id),
            "block_ids": block_ids,
            "num_tokens": len(token_ids),
            "prompt_digest": prompt_digest(token_ids, cache_salt, self.secret),
            "compat_hash": self.compat_hash,
            "expires_at": math.floor(self._wall_clock() + self.expiry_s),
        }
