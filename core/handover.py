"""The two sides of a KV hand-over, each an explicit state machine (pull model,
docs/architecture.md §2).

A hand-over is named by its ``transfer_id``, which the prefill instance makes when it pins a
finished request's blocks and the decode instance echoes back. Each side keeps one object per
live hand-over with an enum state, and changes it only through the functions below, one per
transition; any other transition is a bug (``IllegalTransition``).

Prefill side, one per pinned request (a streamed one, ``tandem.kv_stream``: from admission)::

    STREAMING ──pin (the request ended: its blocks kept)──► PINNED
       └──abandon (refused before it ran: nothing kept)──► RELEASED
    PINNED ──release (the reader notified: read, or will not read)──► RELEASED
       └─────expire (kv_expiry_s passed without a notification)─────► EXPIRED

A STREAMING hand-over's reader may give it up before the pin exists (``given_up``): the pin is
then released as soon as it is made.

Decode side, one per request whose prompt KV comes from a prefill instance::

    ADMITTED ──start (read posted into the request's blocks)──► LOADING ──loaded──► LOADED
       │  │  └──refuse (no read: replayed, unverified, refused)──► FAILED  │
       │  └──cancel (request gone before its read)──► CANCELLED            ├──fail──► FAILED
       │                                          last_announced           └──quarantine──► QUARANTINED
       └──start_stream (blocks given)──► STREAMING ───────────────► LOADING
                                           ├──fail──► FAILED
                                           └──quarantine──► QUARANTINED
                                                      QUARANTINED ──release (read over)──► RELEASED

A streamed hand-over (``tandem.kv_stream``) is STREAMING while the prefill instance still
announces blocks: each announced run is read as it comes (several reads in flight); the last
announcement moves it to LOADING, and it is LOADED once every read landed.

``FAILED``: nothing more lands in the request's blocks; it recomputes its prompt or fails, per
``kv_load_failure_policy``. ``QUARANTINED``: the read may still write into the blocks it was
given — it passed its deadline (UCX over TCP cannot cancel a read already sent: a frozen peer
that resumes still delivers), or its request was aborted while it ran — so those blocks are held
apart from the request, out of the free pool, until the transport reports the read over
(``release``). Terminal states: RELEASED, EXPIRED, LOADED, FAILED, CANCELLED.

Pure Python; driven by ``tandem.kv_transfer.KVTransferCoordinator`` on the engine thread.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class IllegalTransition(AssertionError):
    """A transition the state machine does not have (a bug in the caller)."""


class PrefillState(enum.Enum):
    STREAMING = "streaming"
    PINNED = "pinned"
    RELEASED = "released"
    EXPIRED = "expired"


class DecodeState(enum.Enum):
    ADMITTED = "admitted"
    STREAMING = "streaming"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    QUARANTINED = "quarantined"
    RELEASED = "released"


_DECODE_FINAL = {DecodeState.LOADED, DecodeState.FAILED, DecodeState.CANCELLED, DecodeState.RELEASED}


@dataclass(slots=True)
class PrefillHandover:
    """Blocks of a finished request, pinned under ``pin_id`` for the decode instance to read; a
    streamed one's while it runs too (``num_announced`` of them announced so far)."""

    transfer_id: str
    pin_id: str
    num_blocks: int
    expires_at: float
    state: PrefillState = PrefillState.PINNED
    num_announced: int = 0
    given_up: bool = False
    checksums: list[int] | None = field(default_factory=list)
    """A streamed one's: the checksum of each block announced so far (None: the connector
    cannot checksum)."""


@dataclass(slots=True)
class DecodeHandover:
    """One request's load of its prompt KV from ``peer``. ``quarantine_id`` holds the blocks a
    quarantined read may still write into; ``reason`` says why it failed or was quarantined.

    The load's local blocks receive the remote blocks of logical indices ``first_block ..
    first_block + len(local_block_ids) - 1``; ``num_posted`` of them have a read posted,
    ``reads`` are the connector's ids of the reads not yet over. ``stream``: the remote blocks
    are announced as they are computed (``remote_block_ids`` grows; ``announced_failed``: the
    prefill side gave up)."""

    transfer_id: str
    request_id: str
    peer: str
    engine_id: str
    remote_block_ids: tuple[int, ...]
    stream: bool = False
    state: DecodeState = DecodeState.ADMITTED
    num_blocks: int = 0
    started_at: float = 0.0
    quarantine_id: str | None = None
    reason: str | None = None
    remote_checksums: tuple[int, ...] = ()
    """The prefill instance's checksum of each of ``remote_block_ids`` (empty: none given)."""
    first_block: int = 0
    """The logical index of the first block read (the blocks before it were cached here)."""
    local_block_ids: tuple[int, ...] = ()
    """The blocks the read writes into."""
    num_posted: int = 0
    reads: set[str] = field(default_factory=set)
    num_reads: int = 0
    last_announced: bool = False
    announced_failed: bool = False

    @property
    def finished(self) -> bool:
        return self.state in _DECODE_FINAL


def _move(handover, expected, new) -> None:
    if handover.state not in expected:
        raise IllegalTransition(f"hand-over {handover.transfer_id}: {handover.state.value} → {new.value}")
    handover.state = new


# ------------------------------------------------------------------------------------ prefill


def pin(handover: PrefillHandover, num_blocks: int, expires_at: float) -> None:
    """STREAMING → PINNED: the streamed request ended; ``num_blocks`` blocks are kept."""
    _move(handover, {PrefillState.STREAMING}, PrefillState.PINNED)
    handover.num_blocks, handover.expires_at = num_blocks, expires_at


def abandon(handover: PrefillHandover) -> None:
    """STREAMING → RELEASED: the request was refused before it ran; nothing was kept."""
    _move(handover, {PrefillState.STREAMING}, PrefillState.RELEASED)


def release(handover: PrefillHandover) -> None:
    """PINNED → RELEASED: the reader is done with the blocks (the caller unpins them)."""
    _move(handover, {PrefillState.PINNED}, PrefillState.RELEASED)


def expire(handover: PrefillHandover) -> None:
    """PINNED → EXPIRED: no notification came within ``kv_expiry_s`` (the caller unpins)."""
    _move(handover, {PrefillState.PINNED}, PrefillState.EXPIRED)


# ------------------------------------------------------------------------------------ decode


def start(handover: DecodeHandover, num_blocks: int, now: float) -> None:
    """ADMITTED → LOADING: a read of ``num_blocks`` blocks was posted."""
    _move(handover, {DecodeState.ADMITTED}, DecodeState.LOADING)
    handover.num_blocks, handover.started_at = num_blocks, now


def start_stream(handover: DecodeHandover, num_blocks: int, now: float) -> None:
    """ADMITTED → STREAMING: the request's ``num_blocks`` blocks wait for the announced runs."""
    _move(handover, {DecodeState.ADMITTED}, DecodeState.STREAMING)
    handover.num_blocks, handover.started_at = num_blocks, now


def last_announced(handover: DecodeHandover) -> None:
    """STREAMING → LOADING: the prefill instance announced its last blocks."""
    _move(handover, {DecodeState.STREAMING}, DecodeState.LOADING)
    handover.last_announced = True


def refuse(handover: DecodeHandover, reason: str) -> None:
    """ADMITTED → FAILED: no read will be made (the request's blocks are its own)."""
    _move(handover, {DecodeState.ADMITTED}, DecodeState.FAILED)
    handover.reason = reason


def cancel(handover: DecodeHandover) -> None:
    """ADMITTED → CANCELLED: the request ended before its read started."""
    _move(handover, {DecodeState.ADMITTED}, DecodeState.CANCELLED)


def loaded(handover: DecodeHandover) -> None:
    """LOADING → LOADED: the blocks hold the prompt's KV; the request runs."""
    _move(handover, {DecodeState.LOADING}, DecodeState.LOADED)


def fail(handover: DecodeHandover, reason: str) -> None:
    """LOADING or STREAMING → FAILED: the read ended and nothing more can land (the peer is gone, a transport
    error): the request's blocks are its own again."""
    _move(handover, {DecodeState.LOADING, DecodeState.STREAMING}, DecodeState.FAILED)
    handover.reason = reason


def quarantine(handover: DecodeHandover, quarantine_id: str, reason: str) -> None:
    """LOADING or STREAMING → QUARANTINED: the read may still land; its blocks are held under
    ``quarantine_id`` until ``release_quarantine``."""
    _move(handover, {DecodeState.LOADING, DecodeState.STREAMING}, DecodeState.QUARANTINED)
    handover.quarantine_id, handover.reason = quarantine_id, reason


def release_quarantine(handover: DecodeHandover) -> None:
    """QUARANTINED → RELEASED: the transport says the read is over (the caller frees the blocks)."""
    _move(handover, {DecodeState.QUARANTINED}, DecodeState.RELEASED)
