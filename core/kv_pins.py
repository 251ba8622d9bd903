"""The prefill side of one engine's KV hand-overs: the blocks pinned for decode instances and, for
streamed hand-overs (``disaggregation.stream_kv``), what is announced of them while the prompt is
computed. Driven by ``tandem.kv_transfer.KVTransferCoordinator`` on the engine thread; the flow,
drawn: docs/architecture.md §2.

Each hand-over is a ``tandem.handover.PrefillHandover``: a streamed one is STREAMING from
admission, announced on ``board``, until its request ends and its blocks are PINNED; a pin lasts
until its reader notifies (read, or will not read), the router gives the hand-over up, or
``expiry_s`` passes. A reader that gives a STREAMING hand-over up (the router, or the decode
instance) has its pin released as soon as it is made.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tandem import handover
from tandem.handover import PrefillHandover, PrefillState
from tandem.handover_auth import prompt_digest
from tandem.kv_stream import AnnouncementBoard, KVAnnouncement
from tandem.sched.scheduler import PinnedKV, Scheduler, pin_holder_id

logger = logging.getLogger("tandem")


class PrefillPins:
    """Pins and streamed transfers of one prefill engine (see the module docstring), each a
    ``PrefillHandover`` (STREAMING or PINNED) by transfer id; the coordinator's arguments of the
    same names."""

    def __init__(self, scheduler: Scheduler, *, engine_id: str, compat_hash: str, expiry_s: float,
                 secret: bytes | None, clock: Callable[[], float], wall_clock: Callable[[], float],
                 block_checksums: Callable[[list[int]], list[int] | None] = lambda block_ids: None) -> None:
        """``block_checksums``: the connector's (``KVConnector.block_checksums``), for the
        announcements of streamed transfers."""
        self.scheduler = scheduler
        self.block_checksums = block_checksums
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.expiry_s = expiry_s
        self.secret = secret
        self._clock = clock
        self._wall_clock = wall_clock
        self._handovers: dict[str, PrefillHandover] = {}  # STREAMING or PINNED
        self.board = AnnouncementBoard()

    def _pinned(self) -> list[PrefillHandover]:
        return [h for h in self._handovers.values() if h.state is PrefillState.PINNED]

    @property
    def num_pins(self) -> int:
        return len(self._pinned())

    @property
    def num_pinned_blocks(self) -> int:
        return sum(h.num_blocks for h in self._pinned())

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
        for new in pins:
            transfer_id = self.transfer_id(new.request_id)
            pinned = self._handovers.get(transfer_id)
            if pinned is None:
                pinned = self._handovers[transfer_id] = PrefillHandover(
                    transfer_id, new.pin_id, len(new.block_ids), expires_at)
            else:
                handover.pin(pinned, len(new.block_ids), expires_at)
                self.board.take_params(new.request_id)
                if new.complete:
                    self.board.publish(self._announcement(pinned, list(new.block_ids), "done"))
                else:
                    self.board.publish(KVAnnouncement(transfer_id, (), "failed"))
            if pinned.given_up or not new.block_ids:
                self.release(transfer_id)
            elif new.complete:
                params[new.request_id] = self._hand_over(new.request_id, new.token_ids, new.cache_salt,
                                                         list(new.block_ids))
        return params

    def open_stream(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """STREAMING for ``request_id`` (about to be added with ``RemoteKV.STREAM``): its
        ``kv_transfer_params`` (``block_ids: []``, ``stream: true``) wait on the board for the
        server (``AnnouncementBoard.take_params``), and its first announcement lists no block."""
        transfer_id = self.transfer_id(request_id)
        self._handovers[transfer_id] = PrefillHandover(transfer_id, pin_holder_id(request_id), 0, math.inf,
                                                       state=PrefillState.STREAMING)
        self.board.open(request_id, self._hand_over(request_id, token_ids, cache_salt, []) | {"stream": True})

    def announce(self, progress: list[tuple[str, list[int]]]) -> None:
        """Publish the blocks of streamed transfers that became final (``Scheduler.stream_progress``)."""
        for request_id, block_ids in progress:
            streaming = self._streaming(self.transfer_id(request_id))
            if streaming is not None and len(block_ids) > streaming.num_announced:
                streaming.num_announced = len(block_ids)
                self.board.publish(self._announcement(streaming, block_ids))

    def _announcement(self, streamed: PrefillHandover, block_ids: list[int], state: str = "running") -> KVAnnouncement:
        """``block_ids`` announced for ``streamed``, with their checksums: those of blocks
        announced before are kept (announced blocks are final), the new ones computed."""
        known = streamed.checksums
        if known is not None and len(known) < len(block_ids):
            new = self.block_checksums(block_ids[len(known):])
            streamed.checksums = None if new is None else known + new
        checksums = tuple(streamed.checksums or ())
        return KVAnnouncement(streamed.transfer_id, tuple(block_ids), state,
                              checksums if len(checksums) == len(block_ids) else ())

    def forget_stream(self, request_id: str) -> None:
        """A streamed transfer whose request never made it into the scheduler (refused at
        admission): announced ``failed``, nothing pinned."""
        streaming = self._streaming(self.transfer_id(request_id))
        if streaming is not None and self.scheduler.get_request(request_id) is None:
            handover.abandon(streaming)
            del self._handovers[streaming.transfer_id]
            self.board.take_params(request_id)
            self.board.publish(KVAnnouncement(streaming.transfer_id, (), "failed"))

    def release(self, transfer_id: str) -> bool:
        """Release the pin of ``transfer_id`` now: no decode instance will read it (the router
        gave the hand-over up). A streamed transfer still computing is released once pinned.
        False when there is no such pin or stream; a pin is released once, so a later
        notification or expiry of it finds nothing."""
        known = self._handovers.get(transfer_id)
        if known is None:
            return False
        if known.state is PrefillState.STREAMING:
            known.given_up = True
            return True
        del self._handovers[transfer_id]
        logger.info("KV blocks of %s released unread: the hand-over was given up", transfer_id)
        handover.release(known)
        self.scheduler.release_blocks(known.pin_id)
        return True

    def on_notified(self, transfer_ids: Iterable[str]) -> None:
        """The readers of ``transfer_ids`` are done with them (the connector's notifications)."""
        for transfer_id in transfer_ids:
            known = self._handovers.get(transfer_id)
            if known is None:
                continue
            if known.state is PrefillState.STREAMING:
                known.given_up = True
                continue
            del self._handovers[transfer_id]
            handover.release(known)
            self.scheduler.release_blocks(known.pin_id)

    def expire(self) -> int:
        """EXPIRED for each pin past ``expiry_s``; returns how many."""
        now, expired = self._clock(), 0
        for pinned in self._pinned():
            if now >= pinned.expires_at:
                logger.info("KV blocks of %s expired unclaimed after %.0f s", pinned.transfer_id, self.expiry_s)
                del self._handovers[pinned.transfer_id]
                handover.expire(pinned)
                self.scheduler.release_blocks(pinned.pin_id)
                expired += 1
        return expired

    def _streaming(self, transfer_id: str) -> PrefillHandover | None:
        known = self._handovers.get(transfer_id)
        return known if known is not None and known.state is PrefillState.STREAMING else None

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
