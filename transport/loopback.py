"""The "loopback" KV connector: the ``KVConnector`` contract between instances of one process, for
engine tests without a second process or NIXL.

Connectors of one process find each other's pools by agent name in a module-level registry; a
read copies, with torch index ops, the bytes the read plan names (``tandem.transport.shard_plan``:
whole blocks between pools split alike, each rank's layers and KV heads between pools split
otherwise), from every remote rank the plan reads, and notifies as the NIXL connector does. What a real transport does to a read is reproduced
in-process: ``close()`` is a dead peer (its readers get "error:peer") and ``pause()`` a frozen
one (reads from it stay pending until ``resume()`` or their deadline, "error:deadline"). As over
UCX's TCP transport, a read past its deadline is not taken back: it lands when its owner resumes
(then "closed"), or never if the owner closes ("closed" too).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from tandem.interfaces import KVConnector, KVPoolDescriptor, KVReadCounters
from tandem.transport.compat import base_handshake, check_pool, check_read, peer_ranks, read_plan
from tandem.transport.kv_checksum import BlockChecksums
from tandem.transport.notify import NotificationTally, encode
from tandem.transport.shard_plan import RankPlan

_LIVE: dict[str, LoopbackConnector] = {}
"""Agent name → the registered, not yet closed connector of that name in this process."""


@dataclass(slots=True, frozen=True)
class _Peer:
    agents: list[str]
    """Every remote rank's agent name, in rank order."""
    num_blocks: int
    plan: RankPlan


@dataclass(slots=True)
class _Read:
    peer: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    deadline: float


class LoopbackConnector(KVConnector):
    """In-process KV connector. ``agent_name`` defaults to a random unique one."""

    name = "loopback"

    def __init__(self, agent_name: str | None = None) -> None:
        self.agent_name = agent_name or f"loopback-{uuid.uuid4().hex[:12]}"
        self._blocks: torch.Tensor | None = None
        self._descriptor: KVPoolDescriptor | None = None
        self._handshake: dict[str, Any] = {}
        self._peers: dict[str, _Peer] = {}
        self._reads: dict[str, _Read] = {}
        self._late: dict[str, _Read] = {}  # past their deadline, not taken back
        self._finished: dict[str, str] = {}
        self._notifications: list[str] = []
        self._tally = NotificationTally()
        self._counters = KVReadCounters()
        self._paused = False
        self._checksums: BlockChecksums | None = None

    def register_pool(self, pool: Any, descriptor: KVPoolDescriptor) -> None:
        if self._blocks is not None:
            raise RuntimeError(f"connector {self.agent_name!r} already registered a KV pool")
        if self.agent_name in _LIVE:
            raise ValueError(f"a loopback connector named {self.agent_name!r} is already registered")
        check_pool(pool, descriptor)
        # One row of bytes per block: a block id indexes the pool whatever its dtype and shape.
        self._blocks = pool.view(-1).view(torch.uint8).view(descriptor.num_blocks, descriptor.block_bytes)
        self._descriptor = descriptor
        self._checksums = BlockChecksums(pool, descriptor) if descriptor.shard is not None else None
        self._handshake = base_handshake(self.name, self.agent_name, descriptor)
        _LIVE[self.agent_name] = self

    def handshake_info(self) -> dict[str, Any]:
        self._require_pool()
        return dict(self._handshake)

    def add_peer(self, handshake: dict[str, Any]) -> str:
        self._require_pool()
        ranks = peer_ranks(self._handshake, handshake)
        plan = read_plan(self._descriptor, ranks)
        self._peers[ranks[0]["agent_name"]] = _Peer(
            [r["agent_name"] for r in ranks], min(r["num_blocks"] for r in ranks), plan)
        return ranks[0]["agent_name"]

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
        check_read(transfer_id, remote_block_ids, local_block_ids, known.num_blocks if known else None,
                   self._blocks.shape[0], self._reads.keys() | self._late.keys() | self._finished.keys())
        read = _Read(peer, list(remote_block_ids), list(local_block_ids), time.monotonic() + deadline_s)
        self._reads[transfer_id] = read
        if known is not None and remote_block_ids:
            self._counters = KVReadCounters(
                self._counters.reads + 1,
                self._counters.descriptors + known.plan.descriptors_per_block * len(local_block_ids),
                self._counters.bytes_read + known.plan.bytes_per_block * len(local_block_ids))
        self._advance(transfer_id, read)

    def poll(self) -> dict[str, str]:
        for transfer_id, read in list(self._reads.items()):
            self._advance(transfer_id, read)
        for transfer_id, read in list(self._late.items()):
            owners = self._owners(read)
            if owners is None or not any(owner._paused for owner in owners):
                if owners is not None:
                    self._copy(read)  # the late write a frozen peer makes when it resumes
                del self._late[transfer_id]
                self._finished[transfer_id] = "closed"
        changed, self._finished = self._finished, {}
        return changed

    def get_notifications(self) -> list[str]:
        notifications, self._notifications = self._notifications, []
        return self._tally.add(notifications)

    def read_counters(self) -> list[KVReadCounters]:
        return [self._counters]

    def block_checksums(self, block_ids: list[int]) -> list[int] | None:
        self._require_pool()
        return self._checksums.of(block_ids) if self._checksums is not None else None

    def notify_release(self, peer: str, transfer_id: str) -> None:
        known = self._peers.get(peer)
        if known is None:
            return
        for index, count in known.plan.notify.items():
            owner = _LIVE.get(known.agents[index])
            if owner is not None:
                owner._notifications.append(encode(transfer_id, count).decode())

    def pause(self) -> None:
        """Freeze as a stopped process would: reads from this pool make no progress."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def close(self) -> None:
        if _LIVE.get(self.agent_name) is self:
            del _LIVE[self.agent_name]
        self._reads.clear()
        self._late.clear()

    def _require_pool(self) -> None:
        if self._blocks is None:
            raise RuntimeError(f"connector {self.agent_name!r}: call register_pool first")

    def _owners(self, read: _Read) -> list[LoopbackConnector] | None:
        """The live connectors of the remote ranks ``read`` reads, None when one is gone."""
        known = self._peers.get(read.peer)
        if known is None:
            return None
        owners = [_LIVE.get(known.agents[r.remote_rank]) for r in known.plan.reads]
        return None if None in owners else owners

    def _advance(self, transfer_id: str, read: _Read) -> None:
        owners = self._owners(read)
        if owners is None:
            outcome = "error:peer"
        elif any(owner._paused for owner in owners):
            if time.monotonic() < read.deadline:
                return
            self._late[transfer_id] = read
            outcome = "error:deadline"
        else:
            self._copy(read)
            self.notify_release(read.peer, transfer_id)
            outcome = "done"
        del self._reads[transfer_id]
        self._finished[transfer_id] = outcome

    def _copy(self, read: _Read) -> None:
        """Every run of the plan, from each remote rank's blocks into this pool's."""
        if not read.local_block_ids:
            return
        known = self._peers[read.peer]
        local = torch.tensor(read.local_block_ids)
        remote = torch.tensor(read.remote_block_ids)
        flat = self._blocks.view(-1)
        for part in known.plan.reads:
            owner = _LIVE[known.agents[part.remote_rank]]
            runs = torch.arange(part.run_bytes)
            segments = torch.from_numpy(part.segments)
            src = (remote[:, None, None] * owner._blocks.shape[1] + segments[None, :, 1, None] + runs).reshape(-1)
            dst = (local[:, None, None] * self._blocks.shape[1] + segments[None, :, 0, None] + runs).reshape(-1)
            flat.index_copy_(0, dst.to(flat.device), owner._blocks.view(-1)[src.to(owner._blocks.device)]
                             .to(flat.device))
