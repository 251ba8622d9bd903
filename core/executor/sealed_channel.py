"""The step channel between rank 0 and every other rank: byte messages, each sealed with an HMAC
under the session key (``rank_auth``), checked before anyone unpickles them.

Messages go point to point on the gloo cpu group, rank 0 ↔ rank r only (no tree that relays
through a third rank), in frames of two tensors::

    int64 [n]      uint8 [tag (32) ‖ payload (n - 32)]
                   tag = HMAC(session key, direction ‖ rank r ‖ sequence number ‖ payload)

Every rank calls ``broadcast`` and ``gather`` in the same order, so all keep the same sequence
number: a frame replayed, reordered, reflected or sent to another rank fails its check, and so
does one from a process that has no session key (``ClusterAuthError``, fatal to the rank).
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any

import torch

from tandem.executor.rank_auth import SECRET_SETTING, ClusterAuthError

TAG_BYTES = 32
MAX_FRAME_BYTES = 1 << 32
"""What one frame may make a rank allocate before its tag can be checked."""


class SealedChannel:
    """Rank 0's broadcast to every rank and gather from every rank, of sealed bytes."""

    def __init__(self, session_key: bytes, rank: int, world_size: int, group: Any) -> None:
        self._key = session_key
        self.rank = rank
        self.world_size = world_size
        self._group = group
        self._seq = 0

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0 sends ``payload`` to every rank; every rank returns it (the others pass None)."""
        import torch.distributed as dist

        seq = self._next()
        if self.rank != 0:
            return self._receive(0, b"step", self.rank, seq)
        frames = [(rank, self._frame(b"step", rank, seq, payload)) for rank in range(1, self.world_size)]
        works = [dist.isend(tensor, rank, group=self._group) for rank, frame in frames for tensor in frame]
        for work in works:  # the frames stay referenced until every send is done
            work.wait()
        return payload

    def gather(self, payload: bytes) -> list[bytes] | None:
        """Every rank sends ``payload`` to rank 0, which returns them in rank order (the others
        return None)."""
        import torch.distributed as dist

        seq = self._next()
        if self.rank != 0:
            for tensor in self._frame(b"reply", self.rank, seq, payload):
                dist.send(tensor, 0, group=self._group)
            return None
        return [payload] + [self._receive(r, b"reply", r, seq) for r in range(1, self.world_size)]

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _tag(self, direction: bytes, rank: int, seq: int, payload: bytes) -> bytes:
        head = direction + rank.to_bytes(4, "big") + seq.to_bytes(8, "big")
        return hmac.new(self._key, head + payload, hashlib.sha256).digest()

    def _frame(self, direction: bytes, rank: int, seq: int, payload: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        data = bytearray(self._tag(direction, rank, seq, payload) + payload)
        return torch.tensor([len(data)], dtype=torch.int64), torch.frombuffer(data, dtype=torch.uint8)

    def _receive(self, src: int, direction: bytes, rank: int, seq: int) -> bytes:
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self._group)
        if not TAG_BYTES <= int(size) <= MAX_FRAME_BYTES:
            raise ClusterAuthError(f"rank {self.rank}: a frame of {int(size)} bytes from rank {src} "
                                   "cannot be a sealed message")
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src, group=self._group)
        raw = data.numpy().tobytes()
        tag, payload = raw[:TAG_BYTES], raw[TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(direction, rank, seq, payload)):
            raise ClusterAuthError(
                f"rank {self.rank}: a message from rank {src} is not sealed with this launch's key: a "
                f"process without the cluster secret {SECRET_SETTING} is on the connection. Refused")
        return payload
