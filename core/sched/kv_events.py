"""What the prefix cache did during one engine step, as the block pool records it. Pure Python.

Three events, named and shaped after vLLM's (``tandem.kv_events.wire`` encodes them):

- ``BlockStored``: full blocks entered the cache. ``block_hashes[i]`` is the chained hash of the
  block holding ``token_ids[i*block_size:(i+1)*block_size]``; each block's parent is the one
  before it, the first one's is ``parent_block_hash`` (None: the first block of a sequence, or of
  a salted sequence, whose parent is its salt's seed and not a block);
- ``BlockRemoved``: cached blocks left the cache (evicted for new work, or a reset that could not
  clear everything because some blocks are held);
- ``AllBlocksCleared``: the cache holds nothing any more.

The log is filled on the engine thread and taken once per step (``take``); it is bounded by what
one step can do to the cache (allocations plus registrations), never by time.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events of the current step, in the order they happened; consecutive removals share
    one ``BlockRemoved``."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def stored(self, event: BlockStored) -> None:
        self._events.append(event)

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if not isinstance(last, BlockRemoved):
            last = BlockRemoved()
            self._events.append(last)
        last.block_hashes.append(block_hash)

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first; the log is empty afterwards."""
        events, self._events = self._events, []
        return events
