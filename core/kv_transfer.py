"""The engine side of disaggregated prefill/decode (ARCHITECTURE.md §2, pull model): pins on the
prefill instance, remote loads on the decode instance, both over one ``KVConnector``.

::

    prefill instance                                  decode instance
    request with do_remote_decode finishes            request with do_remote_prefill (its
      → scheduler pins its blocks (PinnedKV)            RemotePrefill) is admitted: blocks for
      → on_new_pins: transfer_id, kv_transfer_params    prompt positions 0..P-2, prefix hits kept
                                                      start_loads: start_read of the blocks
                                                        [first_block, blocks_for(P-1)) only
    poll: notification for transfer_id  <──────────── (the connector notifies when the read ends,
      → release_pin                                    or notify_release when nothing is read)
    poll: pin older than kv_expiry_s → release_pin    poll: "done" → the request runs from P-1
                                                            "error:*" → recompute, or fail it

Called only from the engine thread (``LLMEngine`` owns one coordinator when its role is prefill or
decode); ``poll`` runs every engine iteration, also while idle, so notifications and expiries are
seen without traffic. Transport failures are states, never exceptions out of here.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.interfaces import KVConnector
from tandem.sched.scheduler import PinnedKV, RemoteKVLoad, Scheduler

logger = logging.getLogger("tandem")

_REMOTE_PREFILL_FIELDS = ("engine_id", "transfer_id", "block_ids", "num_tokens", "compat_hash")


class KVTransferFailed(RuntimeError):
    """A request's KV could not be loaded and ``kv_load_failure_policy`` is "fail"."""


@dataclass(slots=True, frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV lives: the prefill answer's ``kv_transfer_params``
    (``block_ids`` cover the prompt's ``num_tokens`` tokens on engine ``engine_id``) and that
    engine's connector handshake."""

    engine_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    compat_hash: str
    handshake: dict[str, Any] = field(hash=False, compare=False)

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
        return cls(str(params["engine_id"]), str(params["transfer_id"]), tuple(block_ids), num_tokens,
                   str(params["compat_hash"]), handshake)


@dataclass(slots=True, frozen=True)
class KVTransferStats:
    """Cumulative counters and gauges of one instance's KV hand-overs, for /metrics."""

    bytes_total: int = 0
    failures: tuple[tuple[str, int], ...] = ()
    pending_release_blocks: int = 0
    num_pins: int = 0
    num_loads: int = 0


@dataclass(slots=True)
class _Pin:
    pin_id: str
    num_blocks: int
    expires_at: float


@dataclass(slots=True)
class _Read:
    request_id: str
    peer: str
    num_blocks: int
    started_at: float


class KVTransferCoordinator:
    """Pins and loads of one engine. ``engine_id`` names this engine in its hand-overs;
    ``compat_hash`` is its pool's (see ``tandem.interfaces.compat_hash``)."""

    def __init__(self, connector: KVConnector, scheduler: Scheduler, *, engine_id: str,
                 compat_hash: str, block_bytes: int, transfer_timeout_s: float, expiry_s: float,
                 failure_policy: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.connector = connector
        self.scheduler = scheduler
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.block_bytes = block_bytes
        self.transfer_timeout_s = transfer_timeout_s
        self.expiry_s = expiry_s
        self.failure_policy = failure_policy
        self._clock = clock
        self._pins: dict[str, _Pin] = {}
        self._peers: dict[str, str] = {}
        self._admitting: dict[str, tuple[RemotePrefill, str]] = {}
        self._reads: dict[str, _Read] = {}
        self._ended: list[tuple[str, str]] = []
        self._bytes_total = 0
        self._failures: Counter[str] = Counter()
        self._durations_s: list[float] = []

    # ------------------------------------------------------------------ queries

    def stats(self) -> KVTransferStats:
        return KVTransferStats(
            bytes_total=self._bytes_total,
            failures=tuple(sorted(self._failures.items())),
            pending_release_blocks=sum(p.num_blocks for p in self._pins.values()),
            num_pins=len(self._pins),
            num_loads=len(self._reads),
        )

    def has_pins(self) -> bool:
        return bool(self._pins)

    def take_transfer_durations(self) -> list[float]:
        """Seconds of each read that completed since the last call."""
        durations, self._durations_s = self._durations_s, []
        return durations

    # ------------------------------------------------------------------ prefill side

    def on_new_pins(self, pins: list[PinnedKV]) -> dict[str, dict[str, Any]]:
        """Track the scheduler's new pins; returns each pinned request's ``kv_transfer_params``
        (without ``handshake_url``, which the server adds)."""
        params = {}
        expires_at = self._clock() + self.expiry_s
        for pin in pins:
            transfer_id = f"{self.engine_id}/{pin.request_id}"
            self._pins[transfer_id] = _Pin(pin.pin_id, len(pin.block_ids), expires_at)
            params[pin.request_id] = {
                "engine_id": self.engine_id,
                "transfer_id": transfer_id,
                "block_ids": list(pin.block_ids),
                "num_tokens": pin.num_tokens,
                "compat_hash": self.compat_hash,
            }
        return params

    def release(self, transfer_id: str) -> bool:
        """Release the pin of ``transfer_id`` now: no decode instance will read it (the router
        gave the hand-over up). False when no such pin is held; a pin is released once, so a
        later notification or expiry of it finds nothing."""
        pin = self._pins.pop(transfer_id, None)
        if pin is None:
            return False
        logger.info("KV blocks of %s released unread: the hand-over was given up", transfer_id)
        self.scheduler.release_pin(pin.pin_id)
        return True

    def _release_pins(self) -> None:
        for transfer_id in self.connector.get_notifications():
            pin = self._pins.pop(transfer_id, None)
            if pin is not None:
                self.scheduler.release_pin(pin.pin_id)
        now = self._clock()
        for transfer_id, pin in list(self._pins.items()):
            if now >= pin.expires_at:
                logger.info("KV blocks of %s expired unclaimed after %.0f s", transfer_id, self.expiry_s)
                del self._pins[transfer_id]
                self.scheduler.release_pin(pin.pin_id)
                self._failures["expired"] += 1

    # ------------------------------------------------------------------ decode side

    def add_remote(self, request_id: str, remote: RemotePrefill) -> None:
        """Prepare ``request_id`` (about to be added to the scheduler with ``load_remote_kv``)
        to load from ``remote``. Adds the peer once per engine id; raises ValueError (from the
        connector's ``add_peer``: compat hash or layout mismatch) when its blocks are unusable."""
        if remote.compat_hash != self.compat_hash:
            raise ValueError(
                f"KV compat hash mismatch: the prefill instance {remote.engine_id!r} has "
                f"{remote.compat_hash!r}, this decode instance {self.compat_hash!r}; both must serve "
                "the same model with the same dtype, layer count, KV heads, head size and block size")
        peer = self._peers.get(remote.engine_id)
        if peer is None:
            peer = self._peers[remote.engine_id] = self.connector.add_peer(remote.handshake)
        self._admitting[request_id] = (remote, peer)

    def forget(self, request_id: str) -> None:
        """``request_id`` ends before admission (aborted, rejected): tell its prefill instance
        that its blocks will not be read. A read already started ends on its own."""
        entry = self._admitting.pop(request_id, None)
        if entry is not None:
            remote, peer = entry
            self.connector.notify_release(peer, remote.transfer_id)

    def start_loads(self, loads: list[RemoteKVLoad]) -> None:
        """Start one read per load: the remote blocks of the same logical indices."""
        for load in loads:
            remote, peer = self._admitting.pop(load.request_id)
            end = load.first_block + len(load.block_ids)
            remote_ids = list(remote.block_ids[load.first_block:end])
            read = _Read(load.request_id, peer, len(load.block_ids), self._clock())
            num_prompt_tokens = self.scheduler.get_request(load.request_id).num_prompt_tokens
            if remote.num_tokens != num_prompt_tokens or len(remote_ids) != len(load.block_ids):
                # the prefill instance tokenized another prompt, or holds too few blocks
                self._end_now(remote.transfer_id, read, "error:mismatch")
                continue
            try:
                self.connector.start_read(remote.transfer_id, peer, remote_ids, list(load.block_ids),
                                          self.transfer_timeout_s)
            except ValueError as exc:
                logger.warning("KV read %s refused: %s", remote.transfer_id, exc)
                self._end_now(remote.transfer_id, read, "error:transfer")
                continue
            self._reads[remote.transfer_id] = read

    def _end_now(self, transfer_id: str, read: _Read, state: str) -> None:
        self._reads[transfer_id] = read
        self._ended.append((transfer_id, state))

    def poll(self) -> list[tuple[str, str]]:
        """Release notified and expired pins; end finished reads. Returns (request id, message)
        of the requests to fail (policy "fail"); under "recompute" they wait again instead."""
        self._release_pins()
        ended, self._ended = self._ended, []
        ended += list(self.connector.poll().items())
        failed = []
        for transfer_id, state in ended:
            read = self._reads.pop(transfer_id, None)
            if read is None:
                continue
            ok = state == "done"
            if ok:
                self._bytes_total += read.num_blocks * self.block_bytes
                self._durations_s.append(self._clock() - read.started_at)
            else:
                reason = state.removeprefix("error:")
                self._failures[reason] += 1
                self.connector.notify_release(read.peer, transfer_id)
                logger.warning("KV read %s failed (%s); policy %s", transfer_id, state, self.failure_policy)
            live = self.scheduler.get_request(read.request_id) is not None
            self.scheduler.finish_remote_load(read.request_id, ok)
            if live and not ok and self.failure_policy == "fail":
                failed.append((read.request_id, f"loading the prompt's KV cache from the prefill "
                                                f"instance failed ({reason})"))
        return failed
