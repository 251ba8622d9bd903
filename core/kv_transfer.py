"""The engine side of disaggregated prefill/decode (docs/architecture.md §2, pull model): it
drives the hand-over state machines of ``tandem.handover`` over one ``KVConnector`` and the
scheduler.

The flow over both sides, drawn: docs/architecture.md §2, "The hand-over on the engine thread".

A transfer id is used once: one in flight, or among the last ``CONSUMED_IDS`` ended, is refused
(``KVTransferReplayed``) and the first hand-over is left alone. A prompt whose digest differs
from the prefilled one is never read (a load failure, "mismatch"), so KV of another prompt, or of
the same prompt under another cache salt, can neither be decoded on nor enter the prefix cache.
The digest is keyed with the cluster secret (``tandem.handover_auth.prompt_digest``); the
server checks the hand-over's signature before it gets here. A peer with a read past its
deadline that may still land is "stalled": hand-overs from it are refused ("peer") until the
read is over; a peer that died is removed from the connector; at most ``MAX_PEERS`` peers are
kept.

A load reads its blocks in one read, or — a streamed hand-over (``tandem.kv_stream``) — one read
per announced run of blocks, each under its own connector id (``<transfer_id>@<n>``); such a
load notifies the prefill instance itself once every read landed, and its blocks stay
quarantined while any of its reads may still land. The prefill side (pins, announcements) is
``tandem.kv_pins.PrefillPins``.

Called only from the engine thread (``LLMEngine`` owns one coordinator when its role is prefill or
decode); ``poll`` runs every engine iteration, also while idle, so notifications, expiries and
late reads are seen without traffic. Transport failures are states, never exceptions out of here.
"""
from __future__ import annotations

import hmac
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem import handover
from tandem.handover import DecodeHandover, DecodeState
from tandem.interfaces import KVConnector, KVPeerUnavailable
from tandem.handover_auth import prompt_digest
from tandem.kv_pins import PrefillPins
from tandem.kv_stream import AnnouncementBoard, KVAnnouncement, format_checksums, parse_checksums
from tandem.sched.scheduler import PinnedKV, RemoteKVLoad, Scheduler, quarantine_holder_id

logger = logging.getLogger("tandem")

CONSUMED_IDS = 65536
"""Ended transfer ids remembered (per decode instance) to refuse replays."""
MAX_PEERS = 256
"""Prefill engines a decode instance keeps connected; the least recently used idle one goes."""
EVENTS_REFRESH_S = 1.0
"""How often ``stats`` asks the connector for its event counts (they may cross to the workers)."""

_REMOTE_PREFILL_FIELDS = ("engine_id", "transfer_id", "block_ids", "num_tokens", "prompt_digest",
                          "compat_hash")


class KVTransferFailed(RuntimeError):
    """A request's KV could not be loaded and ``kv_load_failure_policy`` is "fail"."""


class KVTransferReplayed(ValueError):
    """A hand-over whose transfer id is in flight or was already used (HTTP 409)."""


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV lives: the prefill answer's ``kv_transfer_params``
    (``block_ids`` cover the ``num_tokens`` tokens, whose keyed digest with their cache salt is
    ``prompt_digest``, on engine ``engine_id``) and that engine's connector handshake."""

    engine_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    prompt_digest: str
    compat_hash: str
    handshake: dict[str, Any] = field(hash=False, compare=False)
    kv_checksums: tuple[int, ...] = ()
    """The checksum of each block (``KVConnector.block_checksums``); empty when not given."""
    stream: bool = False
    """The blocks are announced as they are computed (``tandem.kv_stream``); ``block_ids`` is
    empty."""

    @classmethod
    def from_params(cls, params: dict[str, Any], handshake: dict[str, Any]) -> RemotePrefill:
        """Raises ValueError naming what is missing or malformed."""
        missing = [k for k in _REMOTE_PREFILL_FIELDS if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}")
        block_ids = params["block_ids"]
        if not (isinstance(block_ids, list) and all(type(b) is int and b >= 0 for b in block_ids)):
            raise ValueError("kv_transfer_params.block_ids must be a list of block ids")
        num_tokens = params["num_tokens"]
        if type(num_tokens) is not int or num_tokens < 1:
            raise ValueError("kv_transfer_params.num_tokens must be a positive integer")
        checksums = parse_checksums(params.get("kv_checksums"), len(block_ids), "kv_transfer_params.kv_checksums")
        return cls(str(params["engine_id"]), str(params["transfer_id"]), tuple(block_ids), num_tokens,
                   str(params["prompt_digest"]), str(params["compat_hash"]), handshake,
                   checksums, params.get("stream") is True)


@dataclass(slots=True, frozen=True)
class KVTransferStats:
    """Cumulative counters and gauges of one instance's KV hand-overs, for /metrics."""

    bytes_total: int = 0
    reads_total: int = 0
    failures: tuple[tuple[str, int], ...] = ()
    pending_release_blocks: int = 0
    num_pins: int = 0
    num_loads: int = 0
    num_quarantined_blocks: int = 0
    connector_events: tuple[tuple[str, int], ...] = ()
    """``KVConnector.event_counts``, at most ``EVENTS_REFRESH_S`` old."""


class KVTransferCoordinator:
    """Pins and loads of one engine. ``engine_id`` names this engine in its hand-overs;
    ``compat_hash`` is its pool's (see ``tandem.interfaces.compat_hash``); ``secret`` (the
    cluster's, None when the operator opted out) keys the prompt digests. ``clock`` times pins
    and reads; ``wall_clock`` (Unix seconds) stamps a hand-over's ``expires_at``."""

    def __init__(self, connector: KVConnector, scheduler: Scheduler, *, engine_id: str,
                 compat_hash: str, block_bytes: int, transfer_timeout_s: float, expiry_s: float,
                 failure_policy: str, secret: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.block_bytes = block_bytes
        self.transfer_timeout_s = transfer_timeout_s
        self.expiry_s = expiry_s
        self.failure_policy = failure_policy
        self.secret = secret
        self._clock = clock
        self._loads: dict[str, DecodeHandover] = {}  # not yet final, by transfer id
        self._consumed: OrderedDict[str, None] = OrderedDict()  # ended transfer ids
        self._peers: OrderedDict[str, str] = OrderedDict()  # prefill engine id → connector peer
        self._failed: list[tuple[str, str]] = []  # requests to fail, for the next poll
        self._stale_handshakes: deque[str] = deque()  # engines whose peer died, for the server
        self._chunks: dict[str, str] = {}  # connector read id → transfer id, of streamed loads
        self.prefill = PrefillPins(scheduler, engine_id=engine_id, compat_hash=compat_hash,
                                   expiry_s=expiry_s, secret=secret, clock=clock, wall_clock=wall_clock,
                                   block_checksums=connector.block_checksums)
        self._bytes_total = 0
        self._reads_total = 0
        self._failures: Counter[str] = Counter()
        self._durations_s: list[float] = []
        self._events: tuple[tuple[str, int], ...] = ()
        self._events_at = -math.inf

    # ------------------------------------------------------------------ queries

    def stats(self) -> KVTransferStats:
        quarantined = [h for h in self._loads.values() if h.state is DecodeState.QUARANTINED]
        return KVTransferStats(
            bytes_total=self._bytes_total,
            reads_total=self._reads_total,
            failures=tuple(sorted(self._failures.items())),
            pending_release_blocks=self.prefill.num_pinned_blocks,
            num_pins=self.prefill.num_pins,
            num_loads=len(self._loads) - len(quarantined),
            num_quarantined_blocks=sum(h.num_blocks for h in quarantined),
            connector_events=self._connector_events(),
        )

    def _connector_events(self) -> tuple[tuple[str, int], ...]:
        now = self._clock()
        if now - self._events_at >= EVENTS_REFRESH_S:
            self._events_at = now
            self._events = tuple(sorted(self.connector.event_counts().items()))
        return self._events

    def has_pins(self) -> bool:
        return self.prefill.num_pins > 0

    def has_loads(self) -> bool:
        """Hand-overs that are not over: admitted, loading, or quarantined."""
        return bool(self._loads)

    def take_stale_handshakes(self) -> list[str]:
        """Prefill engines whose connector peer was found dead since the last call: their cached
        handshakes are stale (a restarted agent behind the same handshake URL has new metadata)
        and must be fetched again. Safe to call from any thread."""
        stale = []
        while self._stale_handshakes:
            stale.append(self._stale_handshakes.popleft())
        return stale
    def awaits_announcements(self) -> bool:
        """Some load streams and none is admitted or loading: nothing here is urgent until the
        next announcement."""
        states = {h.state for h in self._loads.values()}
        return DecodeState.STREAMING in states and not states & {DecodeState.ADMITTED, DecodeState.LOADING}

    def take_transfer_durations(self) -> list[float]:
        """Seconds of each read that completed since the last call."""
        durations, self._durations_s = self._durations_s, []
        return durations

    # ------------------------------------------------------------------ prefill side

    def on_new_pins(self, pins: list[PinnedKV]) -> dict[str, dict[str, Any]]:
        """See ``PrefillPins.on_new_pins``; the params of a hand-over also carry the checksum of
        each of its blocks (``kv_checksums``) where the connector computes them."""
        params = self.prefill.on_new_pins(pins)
        for request_params in params.values():
            checksums = self.connector.block_checksums(list(request_params["block_ids"]))
            if checksums is not None:
                request_params["kv_checksums"] = format_checksums(checksums)
        return params

    def open_stream(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None) -> None:
        """See ``PrefillPins.open_stream``."""
        self.prefill.open_stream(request_id, token_ids, cache_salt)

    def announce(self, progress: list[tuple[str, list[int]]]) -> None:
        """See ``PrefillPins.announce``."""
        self.prefill.announce(progress)

    def release(self, transfer_id: str) -> bool:
        """See ``PrefillPins.release``."""
        return self.prefill.release(transfer_id)

    @property
    def board(self) -> AnnouncementBoard:
        return self.prefill.board

    def _release_pins(self) -> None:
        self.prefill.on_notified(self.connector.get_notifications())
        expired = self.prefill.expire()
        if expired:
            self._failures["expired"] += expired

    # ------------------------------------------------------------------ decode side

    def admit(self, request_id: str, remote: RemotePrefill, prompt_token_ids: Sequence[int],
              cache_salt: str | None = None) -> bool:
        """Check the hand-over of ``request_id`` (about to be added to the scheduler, with
        ``cache_salt``) and make it ADMITTED. True: add the request with ``remote_kv`` LOAD.
        False: no read will be made (a mismatched prompt or salt, a stalled or unreachable
        peer) and the policy is "recompute": add it as an ordinary request. Raises
        ``KVTransferReplayed`` for a used transfer id, ValueError for an incompatible peer
        (compat hash, layout, a pool of no sane size), ``KVTransferFailed`` where the policy is
        "fail"."""
        transfer_id = remote.transfer_id
        if transfer_id in self._loads or transfer_id in self._consumed:
            raise KVTransferReplayed(f"kv_transfer_params.transfer_id {transfer_id!r} has already "
                                     "been used: a hand-over is read once")
        if remote.compat_hash != self.compat_hash:
            raise ValueError(
                f"KV compat hash mismatch: the prefill instance {remote.engine_id!r} has "
                f"{remote.compat_hash!r}, this decode instance {self.compat_hash!r}; both must serve "
                "the same model and tokenizer with the same dtype, layer count, KV heads, head size "
                "and block size (their tensor and pipeline parallel sizes may differ)")
        reason = None
        expected = prompt_digest(prompt_token_ids, cache_salt, self.secret)
        if remote.num_tokens != len(prompt_token_ids) or not hmac.compare_digest(
                remote.prompt_digest.encode(), expected.encode()):
            reason = "mismatch"  # another prompt (or salt) was prefilled: its KV must not be read
        elif self._stalled(remote.engine_id):
            reason = "peer"
        peer = ""
        if reason is None:
            try:
                peer = self._peer(remote)
            except KVPeerUnavailable as exc:
                logger.warning("%s", exc)
                self._stale_handshakes.append(remote.engine_id)
                reason = "peer"
        load = DecodeHandover(transfer_id, request_id, peer, remote.engine_id, remote.block_ids,
                              remote_checksums=remote.kv_checksums, stream=remote.stream)
        if reason is None:
            self._loads[transfer_id] = load
            return True
        handover.refuse(load, reason)
        self._end(load)
        self._failures[reason] += 1
        message = self._failure_message(load)
        if self.failure_policy == "fail":
            raise KVTransferFailed(message)
        logger.warning("%s; computing the prompt here", message)
        return False

    def forget(self, request_id: str) -> None:
        """``request_id`` ends (aborted, rejected): before its read, the prefill instance learns
        its blocks will not be read; during it, the blocks the read writes into stay quarantined
        (under ``quarantine_holder_id``) until the read is over."""
        self.prefill.forget_stream(request_id)
        load = self._load_of(request_id)
        if load is None:
            return
        if load.state is DecodeState.ADMITTED:
            handover.cancel(load)
            self.connector.notify_release(load.peer, load.transfer_id)
            self._end(load)
        else:
            handover.quarantine(load, quarantine_holder_id(request_id), "aborted")

    def start_loads(self, loads: list[RemoteKVLoad]) -> None:
        """LOADING: one read per load, of the remote blocks with the same logical indices."""
        for new in loads:
            load = self._load_of(new.request_id)
            load.first_block, load.local_block_ids = new.first_block, tuple(new.block_ids)
            if load.stream:
                self._start_stream(load)
                continue
            end = new.first_block + len(new.block_ids)
            remote_ids = list(load.remote_block_ids[new.first_block:end])
            if len(remote_ids) != len(new.block_ids):  # the prefill instance holds too few blocks
                self._refuse_admitted(load, "mismatch")
                continue
            try:
                self.connector.start_read(load.transfer_id, load.peer, remote_ids, list(new.block_ids),
                                          self.transfer_timeout_s)
            except ValueError as exc:
                logger.warning("KV read %s refused: %s", load.transfer_id, exc)
                self._refuse_admitted(load, "transfer")
                continue
            handover.start(load, len(new.block_ids), self._clock())
            self._reads_total += 1
            load.reads.add(load.transfer_id)
            load.num_posted = len(new.block_ids)

    def _start_stream(self, load: DecodeHandover) -> None:
        """STREAMING: read what is announced already; LOADING at once if the last came."""
        if load.announced_failed:
            self._refuse_admitted(load, "peer")
            return
        if load.last_announced and not self._covers(load):
            self._refuse_admitted(load, "mismatch")
            return
        handover.start_stream(load, len(load.local_block_ids), self._clock())
        if load.last_announced:
            handover.last_announced(load)
        self._read_announced(load)

    def on_announcement(self, announcement: KVAnnouncement) -> None:
        """Decode side: the prefill instance's latest word on a streamed load (checked for its
        signature by the server); blocks newly final are read at once. An announcement that
        does not extend the blocks known so far is a mismatch; one of a load that is over or
        not streamed is ignored."""
        load = self._loads.get(announcement.transfer_id)
        if load is None or not load.stream or load.state not in (DecodeState.ADMITTED, DecodeState.STREAMING):
            return
        known = load.remote_block_ids
        reason = None
        if announcement.state == "failed":
            reason = "peer"
        elif announcement.block_ids[:len(known)] != known or not self._extends_checksums(load, announcement):
            reason = "mismatch"
        else:
            load.remote_block_ids = announcement.block_ids
            load.remote_checksums = announcement.checksums
            load.last_announced = announcement.state == "done"
            if load.last_announced and load.state is DecodeState.STREAMING and not self._covers(load):
                reason = "mismatch"
        if load.state is DecodeState.ADMITTED:
            load.announced_failed = reason is not None
            return
        if reason is not None:
            self._give_up(load, reason)
            return
        if load.last_announced:
            handover.last_announced(load)
        self._read_announced(load)

    @staticmethod
    def _extends_checksums(load: DecodeHandover, announcement: KVAnnouncement) -> bool:
        """The checksums of blocks announced before do not change (and once given, are always
        given)."""
        known = load.remote_checksums
        return announcement.checksums[:len(known)] == known and (not known or bool(announcement.checksums))

    @staticmethod
    def _covers(load: DecodeHandover) -> bool:
        return len(load.remote_block_ids) >= load.first_block + len(load.local_block_ids)

    def _read_announced(self, load: DecodeHandover) -> None:
        """Post one read of the announced blocks not yet read (logical ``first_block +
        num_posted`` up to what is announced or needed); LOADED when all have landed."""
        stop = min(len(load.remote_block_ids) - load.first_block, len(load.local_block_ids))
        if stop > load.num_posted:
            read_id = f"{load.transfer_id}@{load.num_reads}"
            start = load.first_block + load.num_posted
            remote_ids = list(load.remote_block_ids[start:load.first_block + stop])
            try:
                self.connector.start_read(read_id, load.peer, remote_ids,
                                          list(load.local_block_ids[load.num_posted:stop]),
                                          self.transfer_timeout_s)
            except ValueError as exc:
                logger.warning("KV read %s refused: %s", read_id, exc)
                self._give_up(load, "transfer")
                return
            load.num_reads += 1
            self._reads_total += 1
            load.reads.add(read_id)
            self._chunks[read_id] = load.transfer_id
            load.num_posted = stop
        self._complete(load)

    def poll(self) -> list[tuple[str, str]]:
        """Release notified and expired pins; advance the loads the connector reports on.
        Returns (request id, message) of the requests to fail (policy "fail"); under
        "recompute" they wait again instead."""
        self._release_pins()
        for read_id, state in self.connector.poll().items():
            transfer_id = self._chunks.get(read_id, read_id)
            if state != "error:deadline":  # the read is over: nothing more lands from it
                self._chunks.pop(read_id, None)
            load = self._loads.get(transfer_id)
            if load is None:
                continue
            if state != "error:deadline":
                load.reads.discard(read_id)
            if load.state in (DecodeState.LOADING, DecodeState.STREAMING):
                self._on_read_ended(load, state)
        for load in [h for h in self._loads.values() if h.state is DecodeState.QUARANTINED]:
            self._release_quarantine_if_over(load)  # an aborted stream may have had no read in flight
        failed, self._failed = self._failed, []
        return failed

    def _on_read_ended(self, load: DecodeHandover, state: str) -> None:
        if state == "done":
            self._complete(load)
            return
        reason = state.removeprefix("error:")
        self._give_up(load, reason)
        if reason == "peer":
            self._drop_peer(load.engine_id)
            self._stale_handshakes.append(load.engine_id)

    def _complete(self, load: DecodeHandover) -> None:
        """LOADED once every block is read and landed and holds what the prefill instance
        checksummed; a checksum that differs gives the load up ("checksum")."""
        if load.state is not DecodeState.LOADING or load.reads or load.num_posted != len(load.local_block_ids):
            return
        if self._checksums_match(load):
            self._loaded(load)
        else:
            self._give_up(load, "checksum")

    def _loaded(self, load: DecodeHandover) -> None:
        handover.loaded(load)
        self._bytes_total += load.num_blocks * self.block_bytes
        self._durations_s.append(self._clock() - load.started_at)
        self.scheduler.finish_remote_load(load.request_id, ok=True)
        if load.stream:  # its reads notified under their own ids: the pin is released here
            self.connector.notify_release(load.peer, load.transfer_id)
        self._end(load)

    def _give_up(self, load: DecodeHandover, reason: str) -> None:
        """A started load that cannot complete: its request recomputes (or fails). Its blocks
        stay quarantined while any of its reads may still land (one past its deadline, or
        others in flight)."""
        rid = load.request_id
        if load.reads:
            handover.quarantine(load, quarantine_holder_id(rid), reason)
            self.scheduler.finish_remote_load(rid, ok=False, quarantine=True)
        else:
            handover.fail(load, reason)
            self.scheduler.finish_remote_load(rid, ok=False)
            self._end(load)
        self.connector.notify_release(load.peer, load.transfer_id)
        self._on_failed(load)

    def _checksums_match(self, load: DecodeHandover) -> bool:
        """Whether the blocks read hold what the prefill instance checksummed (True when either
        side cannot checksum)."""
        if not load.remote_checksums:
            return True
        expected = list(load.remote_checksums[load.first_block:load.first_block + load.num_blocks])
        found = self.connector.block_checksums(list(load.local_block_ids))
        return found is None or found == expected

    def _release_quarantine_if_over(self, load: DecodeHandover) -> None:
        """QUARANTINED → RELEASED once none of its reads can land any more."""
        if load.reads:
            return
        handover.release_quarantine(load)
        self.scheduler.release_blocks(load.quarantine_id)
        if load.stream and load.reason == "aborted":
            self.connector.notify_release(load.peer, load.transfer_id)
        self._end(load)

    def _refuse_admitted(self, load: DecodeHandover, reason: str) -> None:
        """An admitted load that cannot start: the request waits again (or fails)."""
        handover.refuse(load, reason)
        self.scheduler.finish_remote_load(load.request_id, ok=False)
        self.connector.notify_release(load.peer, load.transfer_id)
        self._end(load)
        self._on_failed(load)

    def _on_failed(self, load: DecodeHandover) -> None:
        self._failures[load.reason] += 1
        message = self._failure_message(load)
        logger.warning("%s; policy %s", message, self.failure_policy)
        if self.failure_policy == "fail":
            self._failed.append((load.request_id, message))

    def _failure_message(self, load: DecodeHandover) -> str:
        what = {"mismatch": "the prefill instance prefilled another prompt",
                "peer": "the prefill instance is gone or stalled",
                "deadline": f"no answer within kv_transfer_timeout_s ({self.transfer_timeout_s:g} s)",
                "transfer": "the transport refused the read",
                "checksum": "the blocks read differ from the prefill instance's checksums"}.get(load.reason, load.reason)
        return f"loading the prompt's KV cache from the prefill instance failed ({load.reason}: {what})"

    def _end(self, load: DecodeHandover) -> None:
        """A final state: the transfer id is used up."""
        assert load.finished, load.state
        self._loads.pop(load.transfer_id, None)
        self._consumed[load.transfer_id] = None
        if len(self._consumed) > CONSUMED_IDS:
            self._consumed.popitem(last=False)

    def _load_of(self, request_id: str) -> DecodeHandover | None:
        """The ADMITTED, STREAMING or LOADING hand-over of a live request."""
        for load in self._loads.values():
            if load.request_id == request_id and load.state in (DecodeState.ADMITTED, DecodeState.STREAMING,
                                                                 DecodeState.LOADING):
                return load
        return None

    # ------------------------------------------------------------------ peers

    def _peer(self, remote: RemotePrefill) -> str:
        """The connector peer of ``remote``'s engine, added on first use (raises ValueError for
        an incompatible one, ``KVPeerUnavailable`` for one that cannot be reached); keeps at
        most ``MAX_PEERS``."""
        peer = self._peers.get(remote.engine_id)
        if peer is None:
            peer = self.connector.add_peer(remote.handshake)
            self._peers[remote.engine_id] = peer
            idle = [e for e in self._peers if e != remote.engine_id and not self._busy(e)]
            for engine_id in idle[:max(len(self._peers) - MAX_PEERS, 0)]:
                self._drop_peer(engine_id)
        self._peers.move_to_end(remote.engine_id)
        return peer

    def _busy(self, engine_id: str) -> bool:
        return any(h.engine_id == engine_id for h in self._loads.values())

    def _stalled(self, engine_id: str) -> bool:
        return any(h.engine_id == engine_id and h.state is DecodeState.QUARANTINED and h.reason == "deadline"
                   for h in self._loads.values())

    def _drop_peer(self, engine_id: str) -> None:
        """Forget a prefill engine that died (or is idle and least recently used)."""
        peer = self._peers.pop(engine_id, None)
        if peer is not None and not any(p == peer for p in self._peers.values()):
            self.connector.remove_peer(peer)
