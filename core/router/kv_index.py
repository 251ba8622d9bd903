"""Which instance caches which KV block, as the instances' KV events tell it: the router's view
of every prefix cache, for cache-aware routing.

Per instance (``source``, its URL) the index keeps the block hashes it stored and has not
removed, each with the time it was stored. An entry counts while it is younger than ``ttl_s``;
everything of a source goes at once when its events say so (``AllBlocksCleared``), when its
stream cannot be trusted (``reset``: a sequence gap no replay filled) and when the instance
leaves rotation (``forget``). Thread-safe: the streams write from their threads, the router
reads on its event loop (short critical sections, no I/O under the lock).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from tandem.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class BlockIndex:
    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[str, dict[bytes | int, float]] = {}
        self._lock = threading.Lock()

    def apply(self, source: str, batch: KVEventBatch) -> None:
        """One batch of ``source``'s events, in order."""
        now = self._clock()
        with self._lock:
            blocks = self._blocks.setdefault(source, {})
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for block_hash in event.block_hashes:
                        blocks[block_hash] = now
                elif isinstance(event, BlockRemoved):
                    for block_hash in event.block_hashes:
                        blocks.pop(block_hash, None)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()

    def reset(self, source: str) -> None:
        """Forget what ``source`` caches (its stream lost batches)."""
        self.forget(source)

    def forget(self, source: str) -> None:
        with self._lock:
            self._blocks.pop(source, None)

    def num_blocks(self, source: str) -> int:
        with self._lock:
            return len(self._blocks.get(source, ()))

    def hit_blocks(self, source: str, block_hashes: Sequence[bytes]) -> int:
        """How many of ``block_hashes`` (a prompt's chain, first block first) ``source``
        caches, counted from the first until one is missing or expired."""
        oldest = self._clock() - self.ttl_s
        with self._lock:
            blocks = self._blocks.get(source)
            if not blocks:
                return 0
            for count, block_hash in enumerate(block_hashes):
                stored = blocks.get(block_hash)
                if stored is None or stored < oldest:
                    return count
            return len(block_hashes)
