"""The "loopback" KV connector: the ``KVConnector`` contract between instances of one process, for
engine tests without a second process or NIXL.

Connectors of one process find each other's pools by agent name in a module-level registry; a
read copies the blocks with torch index ops. What a real transport does to a read is reproduced
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

from tandem.interfaces import KVConnector, KVPoolDescriptor
from tandem.transport.compat import base_handshake, check_handshake, check_pool, check_read

_LIVE: dict[str, LoopbackConnector] = {}
"""Agent name → the registered, not yet closed connector of that name in this process."""


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
        self._handshake: dict[str, Any] = {}
        self._peers: dict[str, int] = {}
        self._reads: dict[str, _Read] = {}
        self._late: dict[str, _Read] = {}  # past their deadline, not taken back
        self._finished: dict[str, str] = {}
        self._notifications: list[str] = []
        self._paused = False

    def register_pool(self, pool: Any, descriptor: KVPoolDescriptor) -> None:
        if self._blocks is not None:
            raise RuntimeError(f"connector {self.agent_name!r} already registered a KV pool")
        if self.agent_name in _LIVE:
            raise ValueError(f"a loopback connector named {self.agent_name!r} is already registered")
        check_pool(pool, descriptor)
        # One row of bytes per block: a block id indexes the pool whatever its dtype and shape.
        self._blocks = pool.view(-1).view(torch.uint8).view(descriptor.num_blocks, descriptor.block_bytes)
        self._handshake = base_handshake(self.name, self.agent_name, descriptor)
        _LIVE[self.agent_name] = self

    def handshake_info(self) -> dict[str, Any]:
        self._require_pool()
        return dict(self._handshake)

    def add_peer(self, handshake: dict[str, Any]) -> str:
        self._require_pool()
        check_handshake(self._handshake, handshake)
        self._peers[handshake["agent_name"]] = handshake["num_blocks"]
        return handshake["agent_name"]

    def start_read(
        self,
        transfer_id: str,
        peer: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        deadline_s: float,
    ) -> None:
        self._require_pool()
        check_read(transfer_id, remote_block_ids, local_block_ids, self._peers.get(peer),
                   self._blocks.shape[0], self._reads.keys() | self._late.keys() | self._finished.keys())
        read = _Read(peer, list(remote_block_ids), list(local_block_ids), time.monotonic() + deadline_s)
        self._reads[transfer_id] = read
        self._advance(transfer_id, read)

    def poll(self) -> dict[str, str]:
        for transfer_id, read in list(self._reads.items()):
            self._advance(transfer_id, read)
        for transfer_id, read in list(self._late.items()):
            owner = _LIVE.get(read.peer)
            if owner is None or not owner._paused:
                if owner is not None:
                    self._copy(owner, read)  # the late write a frozen peer makes when it resumes
                del self._late[transfer_id]
                self._finished[transfer_id] = "closed"
        changed, self._finished = self._finished, {}
        return changed

    def get_notifications(self) -> list[str]:
        notifications, self._notifications = self._notifications, []
        return notifications

    def notify_release(self, peer: str, transfer_id: str) -> None:
        owner = _LIVE.get(peer)
        if owner is not None:
            owner._notifications.append(transfer_id)

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

    def _advance(self, transfer_id: str, read: _Read) -> None:
        owner = _LIVE.get(read.peer)
        if owner is None or read.peer not in self._peers:
            outcome = "error:peer"
        elif owner._paused:
            if time.monotonic() < read.deadline:
                return
            self._late[transfer_id] = read
            outcome = "error:deadline"
        else:
            self._copy(owner, read)
            self.notify_release(read.peer, transfer_id)
            outcome = "done"
        del self._reads[transfer_id]
        self._finished[transfer_id] = outcome

    def _copy(self, owner: LoopbackConnector, read: _Read) -> None:
        if not read.local_block_ids:
            return
        src = torch.tensor(read.remote_block_ids, device=owner._blocks.device)
        dst = torch.tensor(read.local_block_ids, device=self._blocks.device)
        self._blocks.index_copy_(0, dst, owner._blocks.index_select(0, src).to(self._blocks.device))
