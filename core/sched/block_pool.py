"""The physical KV blocks of one instance: reference counts, a free queue in eviction order, and
the prefix-cache map from chained block hashes to blocks. Pure Python.

A block is *free* when no request holds it (``ref_count == 0``). A free block may still be
*cached*: its KV stays valid and a request with the same prefix can take it back (``touch``)
until its memory is needed. The free queue is ordered by eviction::

    front (handed out first)                                        back (handed out last)
    [ free, never cached ... | cached, released earliest ... cached, released latest ]

Allocation pops the front; a popped block that was cached leaves the cache map (evicted).
Block 0 is the null block: it is never queued, never handed out. With an event log
(``events``), every block leaving the cache map is recorded there (``tandem.sched.kv_events``);
blocks entering it are recorded by the allocator, which knows their tokens.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tandem.sched.kv_events import KVEventLog


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The 128-bit chained hash of one full block: blake2b over the parent block's hash (nothing
    for the first block) and the block's token ids as signed 64-bit integers. Equal hashes mean
    equal token prefixes up to and including this block (a collision needs ~2**64 blocks)."""
    digest = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        digest.update(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def salt_seed(salt: str | None) -> bytes | None:
    """The parent hash of a sequence's first block: none, or one derived from its cache salt."""
    return None if salt is None else hashlib.blake2b(salt.encode(), digest_size=16).digest()


def extend_chain(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int,
                 cache_salt: str | None) -> list[bytes]:
    """Append to ``hashes`` (the chain of the first ``len(hashes)`` blocks of ``token_ids``) the
    hashes of the blocks up to ``num_blocks``; returns ``hashes``. Block ``i`` holds
    ``token_ids[i*block_size:(i+1)*block_size]``; the first block's parent is the salt's seed.
    The router computes a prompt's chain with this too, so both sides agree."""
    assert num_blocks * block_size <= len(token_ids)
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else salt_seed(cache_salt)
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block. ``block_hash`` is set while the block is in the prefix cache."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """Blocks ``0 .. num_blocks-1``; block 0 is the null block and is never handed out."""

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"a block pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self._cache: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds: never-cached ones plus cached ones that can be evicted."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def allocate(self) -> KVBlock:
        """Hand out the block at the front of the free queue with ``ref_count = 1``, evicting it
        from the prefix cache if it was cached. The caller checks ``num_free_blocks`` first."""
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            del self._cache[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None
            self.num_evictions += 1
        block.ref_count = 1
        return block

    def touch(self, block: KVBlock) -> None:
        """Take one more reference; a free (cached) block leaves the free queue."""
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference of each block, in the given order. A block reaching 0 joins the free
        queue: at the back when cached (evicted after every block released before it), at the
        front when not (reused before any cached block)."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} released more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cache.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full block under its chained hash; whether it entered the cache. No-op
        (False) when the block is already cached, or when another block already holds that hash
        (the same tokens computed twice)."""
        if block.block_hash is None and block_hash not in self._cache:
            block.block_hash = block_hash
            self._cache[block_hash] = block
            return True
        return False

    def check_consistency(self, holders: Mapping[int, int]) -> None:
        """Raise ``AssertionError`` unless every block's reference count equals ``holders[id]``
        (how many block tables hold it), exactly the unreferenced blocks are in the free queue,
        and the cache map and the blocks' hashes agree."""
        for block in self.blocks[1:]:
            held = holders.get(block.block_id, 0)
            assert block.ref_count == held, (
                f"block {block.block_id} has ref_count {block.ref_count} but {held} holders")
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id} (ref_count {block.ref_count}) is "
                f"{'' if block.block_id in self._free else 'not '}in the free queue")
            if block.block_hash is not None:
                assert self._cache.get(block.block_hash) is block, f"block {block.block_id}'s hash is not mapped to it"
        assert self.blocks[0].ref_count == 0 and 0 not in self._free and 0 not in holders, "the null block is in use"
        assert len(self._cache) == sum(b.block_hash is not None for b in self.blocks), "stale cache entries"

    def reset_cache(self) -> int:
        """Forget every cached block no request holds; returns how many were forgotten. Logged as
        ``AllBlocksCleared`` when the cache is empty afterwards, else as their removal."""
        stale = [h for h, b in self._cache.items() if b.ref_count == 0]
        for block_hash in stale:
            block = self._cache.pop(block_hash)
            block.block_hash = None
            self._free.move_to_end(block.block_id, last=False)
        if self.events is not None and not self._cache:
            self.events.cleared()
        elif self.events is not None:
            for block_hash in stale:
                self.events.removed(block_hash)
        return len(stale)
