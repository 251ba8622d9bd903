"""The "nixl" KV connector: one-sided READs of KV blocks through a NIXL agent (UCX backend).

Set-up, once per instance and once per peer::

    register_pool     a NIXL agent (UCX backend, ``tandem.transport.nixl_agent``) registers the
                      whole pool as one region: host memory → "DRAM", CUDA → "VRAM"
    handshake_info    agent metadata (base64), base address, layout and shard, compat_hash
    add_peer          the peer's ranks (``tandem.transport.compat.peer_ranks``: one, or a
                      tensor/pipeline-parallel instance's every rank), this rank's read plan
                      (``tandem.transport.shard_plan``), and the metadata of each remote agent
                      the plan reads from or notifies

Per request, ``start_read`` makes one READ per remote rank of the plan, of exactly the bytes it
names in the given blocks: one descriptor per block when the two ranks hold the same layers and
heads (instances split alike), else one per (layer, K/V, token) run of the heads this rank owns
— always exactly this rank's KV, never a staging copy. Each read carries the notification
``tandem.transport.notify`` encodes; a remote rank the plan names but reads nothing from gets it
by ``genNotif`` instead. ``poll`` reports a transfer once each of its reads ended. The owner
learns a transfer id through ``get_notifications`` once every reader of each rank told it.
Between two processes of one host UCX reads through shared memory (cma) inside ``start_read``
itself, at about a single-threaded memcpy's speed; over TCP the read runs in the background.

Failures, as seen on loopback TCP and shared memory: a killed peer raises
``nixlRemoteDisconnectError`` within milliseconds ("error:peer"); a frozen peer leaves a transfer in
"PROC" forever, hence the per-transfer deadline, after which it is reported "error:deadline". What
happens to the read then differs: over UCX's TCP transport (``UCX_TLS=tcp``) a frozen peer that
resumes still delivers the whole read into the local blocks, whether the request was released
(cancelled) first or the peer's metadata invalidated. So a transfer past its deadline is not
released: its request stays watched, and once it reports done (the late data arrived) or the peer
is gone (a killed peer's pending read writes nothing), ``poll`` reports the transfer "closed" and
its local blocks become the caller's. For the same reason a transfer one of whose reads failed
is reported only once its other reads ended too.

A known fault of UCX's TCP path, not of this module: UCX emulates a READ over TCP in software (the
owner's worker answers each GET request with active messages), and a reply that UCX sends on an
endpoint it has just marked failed (the reader died) aborts the owner process ("ucp_request.inl:
Fatal: unexpected error: Endpoint timeout", from ``ucp_request_try_send``, which takes any error but
"no resource" as fatal). Not rare on a 2-core machine (docs/benchmarks.md has the counts), and only
over UCX's TCP path: over shared memory the owner's worker takes no part in a read.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from tandem.interfaces import KVConnector, KVPeerUnavailable, KVPoolDescriptor, KVReadCounters
from tandem.transport.compat import KVHandshakeError, base_handshake, check_pool, check_read, peer_ranks, read_plan
from tandem.transport.kv_checksum import BlockChecksums
from tandem.transport.nixl_agent import NixlAgent, back_with_huge_pages
from tandem.transport.notify import NotificationTally, encode
from tandem.transport.shard_plan import RankPlan, transfer_descs

logger = logging.getLogger("tandem.transport")

_PEER_FIELDS = ("agent_metadata", "base_address", "mem_type", "device_id")


@dataclass(slots=True, frozen=True)
class _RemoteRank:
    agent: str
    base_address: int
    block_bytes: int
    mem_type: str
    device_id: int


@dataclass(slots=True)
class _Peer:
    name: str
    key: str
    """A digest of every rank's handshake: a restarted rank (new agent metadata) changes it."""
    num_blocks: int
    ranks: list[_RemoteRank]
    plan: RankPlan
    agents: list[str]
    """The remote agents loaded for this peer (the plan's readers and notified ranks)."""


@dataclass(slots=True)
class _Transfer:
    peer: str
    requests: list[int]
    deadline: float
    failed: str | None = None
    """The failure of a read that could not be posted (its siblings were)."""


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
        self._descriptor: KVPoolDescriptor | None = None
        self._mem_type = "DRAM"
        self._device_id = 0
        self._handshake: dict[str, Any] = {}
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[str, _Transfer] = {}
        self._late: dict[str, _Transfer] = {}  # past their deadline, still watched
        self._finished: dict[str, str] = {}
        self._unreleased: list[int] = []
        self._tally = NotificationTally()
        self._counters = KVReadCounters()
        self._checksums: BlockChecksums | None = None

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
        self._agent, self._pool, self._descriptor = agent, pool, descriptor
        self._mem_type, self._device_id = mem_type, device_id
        self._checksums = BlockChecksums(pool, descriptor) if descriptor.shard is not None else None
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
        ranks = peer_ranks(self._handshake, handshake)
        for rank in ranks:
            missing = [key for key in _PEER_FIELDS if key not in rank]
            if missing:
                raise KVHandshakeError(f"KV peer handshake lacks {missing}")
        name = ranks[0]["agent_name"]
        key = hashlib.sha256(json.dumps(ranks, sort_keys=True, default=str).encode()).hexdigest()
        known = self._peers.get(name)
        if known is not None and known.key == key:
            return name
        plan = read_plan(self._descriptor, ranks)
        if known is not None:  # the same name restarted: its old endpoints are dead
            self._drop_peer(known)
        remote = [_RemoteRank(r["agent_name"], r["base_address"], r["block_bytes"], r["mem_type"],
                              r["device_id"]) for r in ranks]
        agents: list[str] = []
        try:
            for index in sorted({read.remote_rank for read in plan.reads} | plan.notify.keys()):
                try:
                    loaded = self._agent.load_peer(base64.b64decode(ranks[index]["agent_metadata"]))
                except Exception as exc:  # its agent is gone: no connection to its address
                    raise KVPeerUnavailable(f"cannot reach KV peer {name!r}: {type(exc).__name__}: {exc}") from exc
                agents.append(loaded)
                if loaded != remote[index].agent:
                    raise KVHandshakeError(f"cannot load KV peer {name!r}: its metadata names agent {loaded!r}")
        except Exception:
            self._forget_agents(agents)
            raise
        self._peers[name] = _Peer(name, key, min(r["num_blocks"] for r in ranks), remote, plan, agents)
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
                   known.num_blocks if known else None, self._descriptor.num_blocks,
                   self._transfers.keys() | self._late.keys() | self._finished.keys())
        if known is None:
            self._finished[transfer_id] = "error:peer"
            return
        if not remote_block_ids:
            self.notify_release(peer, transfer_id)
            self._finished[transfer_id] = "done"
            return
        transfer = _Transfer(peer, [], time.monotonic() + deadline_s)
        try:
            for read in known.plan.reads:
                transfer.requests.append(
                    self._post_read(known, read, transfer_id, remote_block_ids, local_block_ids))
        except Exception as exc:
            transfer.failed = self._error_of(exc, transfer_id)
            if not transfer.requests:
                self._finished[transfer_id] = transfer.failed
                return
            # the reads already posted may still land: reported once they ended, as any failure
        self._notify_unread(known, transfer_id)
        self._transfers[transfer_id] = transfer
        if transfer.failed is not None:
            return
        plan = known.plan
        self._counters = KVReadCounters(
            self._counters.reads + 1,
            self._counters.descriptors + plan.descriptors_per_block * len(local_block_ids),
            self._counters.bytes_read + plan.bytes_per_block * len(local_block_ids))

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
            self._release_all(transfer)
            changed[transfer_id] = {"DONE": "done", "ERR": "error:peer"}.get(state, state)
        for transfer_id, transfer in list(self._late.items()):
            if self._state(transfer_id, transfer) != "PROC":
                del self._late[transfer_id]
                self._release_all(transfer)
                changed[transfer_id] = "closed"
        self._retry_releases()
        return changed

    def read_counters(self) -> list[KVReadCounters]:
        return [self._counters]

    def block_checksums(self, block_ids: list[int]) -> list[int] | None:
        self._require_pool()
        return self._checksums.of(block_ids) if self._checksums is not None else None

    def remove_peer(self, peer: str) -> None:
        known = self._peers.get(peer)
        if known is not None:
            self._drop_peer(known)

    def notify_release(self, peer: str, transfer_id: str) -> None:
        known = self._peers.get(peer)
        if known is None:
            return
        for index, count in known.plan.notify.items():
            self._notify(known.ranks[index].agent, transfer_id, count)

    # ------------------------------------------------------------------ owner side

    def get_notifications(self) -> list[str]:
        if self._agent is None:
            return []
        try:
            messages = self._agent.notifications()
        except Exception as exc:
            logger.warning("cannot read KV notifications: %s", exc)
            return []
        return self._tally.add(messages)

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        if self._agent is None:
            return
        for transfer in (*self._transfers.values(), *self._late.values()):
            self._release_all(transfer)
        self._transfers.clear()
        self._late.clear()
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
        self._retry_releases()
        self._agent.deregister(self._registration)
        self._agent = self._registration = self._pool = self._checksums = None

    # ------------------------------------------------------------------ helpers

    def _require_pool(self) -> None:
        if self._agent is None:
            raise RuntimeError(f"connector {self.agent_name!r}: call register_pool first")

    def _post_read(self, peer: _Peer, read: Any, transfer_id: str, remote_block_ids: list[int],
                   local_block_ids: list[int]) -> int:
        remote = peer.ranks[read.remote_rank]
        local = self._descriptor
        local_descs = transfer_descs(local.base_address, local.block_bytes, local_block_ids,
                                     read.segments[:, 0], read.run_bytes, self._device_id)
        remote_descs = transfer_descs(remote.base_address, remote.block_bytes, remote_block_ids,
                                      read.segments[:, 1], read.run_bytes, remote.device_id)
        request = self._agent.create_read(local_descs, self._mem_type, remote.agent, remote_descs,
                                          remote.mem_type,
                                          encode(transfer_id, peer.plan.notify[read.remote_rank]))
        try:
            self._agent.post(request)
        except Exception:
            self._release(request)
            raise
        return request

    def _notify_unread(self, peer: _Peer, transfer_id: str) -> None:
        """The remote ranks this rank must notify but reads nothing from."""
        read = {r.remote_rank for r in peer.plan.reads}
        for index, count in peer.plan.notify.items():
            if index not in read:
                self._notify(peer.ranks[index].agent, transfer_id, count)

    def _notify(self, agent: str, transfer_id: str, count: int) -> None:
        try:
            self._agent.notify(agent, encode(transfer_id, count))
        except Exception as exc:
            logger.warning("cannot notify KV peer %r of %r: %s", agent, transfer_id, exc)

    def _state(self, transfer_id: str, transfer: _Transfer) -> str:
        """"PROC" while any read of the transfer runs; then "DONE" or the first failure."""
        states = []
        for request in transfer.requests:
            try:
                states.append(self._agent.state(request))
            except Exception as exc:
                states.append(self._error_of(exc, transfer_id))
        if "PROC" in states:
            return "PROC"
        if transfer.failed is not None:
            return transfer.failed
        return next((state for state in states if state != "DONE"), "DONE")

    def _error_of(self, exc: Exception, transfer_id: str) -> str:
        if isinstance(exc, self._agent.peer_errors):
            return "error:peer"
        logger.warning("KV transfer %r failed: %s: %s", transfer_id, type(exc).__name__, exc)
        return "error:transfer"

    def _release_all(self, transfer: _Transfer) -> None:
        for request in transfer.requests:
            self._release(request)

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
                    self._release_all(transfer)
                    self._finished[transfer_id] = outcome
        del self._peers[peer.name]
        self._forget_agents(peer.agents)

    def _forget_agents(self, agents: list[str]) -> None:
        for agent in agents:
            try:
                self._agent.drop_peer(agent)
            except Exception as exc:
                logger.warning("cannot remove KV peer %r: %s", agent, exc)
