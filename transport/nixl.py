"""The "nixl" KV connector: one-sided READs of whole KV blocks through a NIXL agent (UCX backend).

Set-up, once per instance and once per peer::

    register_pool     a NIXL agent (UCX backend, ``tandem.transport.nixl_agent``) registers the
                      whole pool as one region: host memory → "DRAM", CUDA → "VRAM"; the local
                      descriptor list is prepared once, one descriptor per block:
                      (base + i * block_bytes, block_bytes, device) for i in 0..num_blocks-1
    handshake_info    agent metadata (base64), base address, layout, compat_hash (cached)
    add_peer          load the peer's agent metadata; its descriptor list prepared the same way

Per request, ``start_read`` makes one prepared READ of exactly the given blocks (descriptor
``remote[i]`` into ``local[i]``) with the transfer id as its notification, and posts it; ``poll``
checks each transfer's state. The owner receives the notification once the reader's data has
arrived and learns the id through ``get_notifications``. Between two processes of one host UCX
reads through shared memory (cma) inside ``start_read`` itself, at about a single-threaded
memcpy's speed; over TCP the read runs in the background.

Failures, as seen on loopback TCP and shared memory: a killed peer raises
``nixlRemoteDisconnectError`` within milliseconds ("error:peer"); a frozen peer leaves a transfer in
"PROC" forever, hence the per-transfer deadline, after which it is reported "error:deadline". What
happens to the read then differs: over UCX's TCP transport (``UCX_TLS=tcp``) a frozen peer that
resumes still delivers the whole read into the local blocks, whether the request was released
(cancelled) first or the peer's metadata invalidated. So a transfer past its deadline is not
released: its request stays watched, and once it reports done (the late data arrived) or the peer
is gone (a killed peer's pending read writes nothing), ``poll`` reports the transfer "closed" and
its local blocks become the caller's.
"""
from __future__ import annotations

import base64
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.interfaces import KVConnector, KVPoolDescriptor
from tandem.transport.compat import KVHandshakeError, base_handshake, check_handshake, check_pool, check_read
from tandem.transport.nixl_agent import NixlAgent, back_with_huge_pages

logger = logging.getLogger("tandem.transport")

_PEER_FIELDS = ("agent_metadata", "base_address", "mem_type", "device_id")


def _block_descs(base_address: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """One descriptor (address, length, device) per block of a block-major pool."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_address + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


@dataclass(slots=True)
class _Peer:
    name: str
    metadata: str
    num_blocks: int
    dlist: int


@dataclass(slots=True)
class _Transfer:
    peer: str
    request: int
    deadline: float


class NixlConnector(KVConnector):
    """KV blocks over NIXL/UCX. ``agent_name`` must be unique among the peers (default: a random
    one); ``progress_delay_us`` is the idle wake-up period of NIXL's progress thread."""

    name = "nixl"

    def __init__(self, agent_name: str | None = None, progress_delay_us: int = 1000) -> None:
        self.agent_name = agent_name or f"tandem-{uuid.uuid4().hex[:12]}"
        self._progress_delay_us = progress_delay_us
        self._agent: NixlAgent | None = None
        self._pool: Any = None
        self._registration: Any = None
        self._local_dlist = 0
        self._num_blocks = 0
        self._handshake: dict[str, Any] = {}
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._late: dict[str, _Transfer] = {}  # past their deadline, still watched
        self._finished: dict[str, str] = {}
        self._unreleased: list[int] = []

    # ------------------------------------------------------------------ set-up

    def register_pool(self, pool: Any, descriptor: KVPoolDescriptor) -> None:
        if self._agent is not None:
            raise RuntimeError(f"connector {self.agent_name!r} already registered a KV pool")
        check_pool(pool, descriptor)
        mem_type = "DRAM" if pool.device.type == "cpu" else "VRAM"
        device_id = pool.device.index or 0
        agent = NixlAgent(self.agent_name, self._progress_delay_us)
        if mem_type == "DRAM":
            back_with_huge_pages(descriptor.base_address, descriptor.num_blocks * descriptor.block_bytes)
        self._registration = agent.register(
            descriptor.base_address, descriptor.num_blocks * descriptor.block_bytes, device_id, mem_type)
        descs = _block_descs(descriptor.base_address, descriptor.num_blocks,
                             descriptor.block_bytes, device_id)
        self._local_dlist = agent.prep_dlist(None, descs, mem_type)
        self._agent, self._pool = agent, pool
        self._num_blocks = descriptor.num_blocks
        self._handshake = base_handshake(self.name, self.agent_name, descriptor) | {
            "agent_metadata": base64.b64encode(agent.metadata()).decode("ascii"),
            "base_address": descriptor.base_address,
            "mem_type": mem_type,
            "device_id": device_id,
        }

    def handshake_info(self) -> dict[str, Any]:
        self._require_pool()
        return dict(self._handshake)

    def add_peer(self, handshake: dict[str, Any]) -> str:
        self._require_pool()
        check_handshake(self._handshake, handshake)
        missing = [key for key in _PEER_FIELDS if key not in handshake]
        if missing:
            raise KVHandshakeError(f"KV peer handshake lacks {missing}")
        name = handshake["agent_name"]
        known = self._peers.get(name)
        if known is not None and known.metadata == handshake["agent_metadata"]:
            return name
        if known is not None:  # the same name restarted: its old endpoints are dead
            self._drop_peer(known)
        try:
            loaded = self._agent.load_peer(base64.b64decode(handshake["agent_metadata"]))
            if loaded != name:
                raise ValueError(f"its metadata names agent {loaded!r}")
            descs = _block_descs(handshake["base_address"], handshake["num_blocks"],
                                 handshake["block_bytes"], handshake["device_id"])
            dlist = self._agent.prep_dlist(name, descs, handshake["mem_type"])
        except Exception as exc:
            raise KVHandshakeError(f"cannot load KV peer {name!r}: {type(exc).__name__}: {exc}") from exc
        self._peers[name] = _Peer(name, handshake["agent_metadata"], handshake["num_blocks"], dlist)
        return name

    # ------------------------------------------------------------------ reader side

    def start_read(
        self,
        transfer_id: str,
        peer: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        deadline_s: float,
    ) -> None:
        self._require_pool()
        known = self._peers.get(peer)
        check_read(transfer_id, remote_block_ids, local_block_ids,
                   known.num_blocks if known else None, self._num_blocks,
                   self._transfers.keys() | self._late.keys() | self._finished.keys())
        if known is None:
            self._finished[transfer_id] = "error:peer"
            return
        if not remote_block_ids:
            self.notify_release(peer, transfer_id)
            self._finished[transfer_id] = "done"
            return
        try:
            request = self._agent.make_read(self._local_dlist, list(local_block_ids), known.dlist,
                                            list(remote_block_ids), transfer_id.encode())
        except Exception as exc:
            self._finished[transfer_id] = self._error_of(exc, transfer_id)
            return
        try:
            self._agent.post(request)
        except Exception as exc:
            self._release(request)
            self._finished[transfer_id] = self._error_of(exc, transfer_id)
            return
        self._transfers[transfer_id] = _Transfer(peer, request, time.monotonic() + deadline_s)

    def poll(self) -> dict[str, str]:
        changed, self._finished = self._finished, {}
        now = time.monotonic()
        for transfer_id, transfer in list(self._transfers.items()):
            state = self._state(transfer_id, transfer)
            if state == "PROC":
                if now >= transfer.deadline:
                    del self._transfers[transfer_id]
                    self._late[transfer_id] = transfer
                    changed[transfer_id] = "error:deadline"
                continue
            del self._transfers[transfer_id]
            self._release(transfer.request)
            changed[transfer_id] = {"DONE": "done", "ERR": "error:peer"}.get(state, state)
        for transfer_id, transfer in list(self._late.items()):
            if self._state(transfer_id, transfer) != "PROC":
                del self._late[transfer_id]
                self._release(transfer.request)
                changed[transfer_id] = "closed"
        self._retry_releases()
        return changed

    def remove_peer(self, peer: str) -> None:
        known = self._peers.get(peer)
        if known is not None:
            self._drop_peer(known)

    def notify_release(self, peer: str, transfer_id: str) -> None:
        try:
            self._agent.notify(peer, transfer_id.encode())
        except Exception as exc:
            logger.warning("cannot notify KV peer %r of %r: %s", peer, transfer_id, exc)

    # ------------------------------------------------------------------ owner side

    def get_notifications(self) -> list[str]:
        if self._agent is None:
            return []
        try:
            messages = self._agent.notifications()
        except Exception as exc:
            logger.warning("cannot read KV notifications: %s", exc)
            return []
        return [message.decode() for message in messages]

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if self._agent is None:
            return
        for transfer in (*self._transfers.values(), *self._late.values()):
            self._release(transfer.request)
        self._transfers.clear()
        self._late.clear()
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
        self._retry_releases()
        self._agent.release_dlist(self._local_dlist)
        self._agent.deregister(self._registration)
        self._agent = self._registration = self._pool = None

    # ------------------------------------------------------------------ helpers

    def _require_pool(self) -> None:
        if self._agent is None:
            raise RuntimeError(f"connector {self.agent_name!r}: call register_pool first")

    def _state(self, transfer_id: str, transfer: _Transfer) -> str:
        try:
            return self._agent.state(transfer.request)
        except Exception as exc:
            return self._error_of(exc, transfer_id)

    def _error_of(self, exc: Exception, transfer_id: str) -> str:
        if isinstance(exc, self._agent.peer_errors):
            return "error:peer"
        logger.warning("KV transfer %r failed: %s: %s", transfer_id, type(exc).__name__, exc)
        return "error:transfer"

    def _release(self, request: int) -> None:
        try:
            self._agent.release(request)
        except Exception:
            # NIXL could not cancel it yet; it stays ours until a later poll releases it.
            self._unreleased.append(request)

    def _retry_releases(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for request in pending:
            self._release(request)

    def _drop_peer(self, peer: _Peer) -> None:
        for transfers, outcome in ((self._transfers, "error:peer"), (self._late, "closed")):
            for transfer_id, transfer in list(transfers.items()):
                if transfer.peer == peer.name:
                    del transfers[transfer_id]
                    self._release(transfer.request)
                    self._finished[transfer_id] = outcome
        del self._peers[peer.name]
        self._agent.release_dlist(peer.dlist)
        try:
            self._agent.drop_peer(peer.name)
        except Exception as exc:
            logger.warning("cannot remove KV peer %r: %s", peer.name, exc)
