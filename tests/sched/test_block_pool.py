"""BlockPool: ref counts, the free queue's eviction order, the prefix-cache map, chained hashes."""
import hashlib
import struct

import pytest

from tandem.sched.block_pool import BlockPool, hash_block_tokens


def _blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def test_hash_of_first_block_is_blake2b_of_the_int64_tokens():
    expected = _blake(struct.pack("=3q", 5, -1, 2**40))
    assert hash_block_tokens(None, [5, -1, 2**40]) == expected


def test_hash_chains_the_parent_hash():
    parent = _blake(struct.pack("=2q", 1, 2))
    expected = _blake(parent + struct.pack("=2q", 3, 4))
    assert hash_block_tokens(parent, [3, 4]) == expected
    assert hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4]) != expected


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_allocation_skips_the_null_block_and_goes_in_id_order():
    pool = BlockPool(4)
    ids = [pool.allocate().block_id for _ in range(3)]
    assert ids == [1, 2, 3]
    assert pool.num_free_blocks == 0
    assert all(pool.blocks[i].ref_count == 1 for i in ids)
    assert pool.blocks[0].ref_count == 0


def test_touch_and_release_count_references():
    pool = BlockPool(3)
    block = pool.allocate()
    pool.touch(block)
    assert block.ref_count == 2
    pool.release([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    pool.release([block])
    assert block.ref_count == 0 and pool.num_free_blocks == 2


def test_release_below_zero_is_an_invariant_violation():
    pool = BlockPool(3)
    block = pool.allocate()
    pool.release([block])
    with pytest.raises(AssertionError):
        pool.release([block])


def test_uncached_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(5)
    a, b, c, d = (pool.allocate() for _ in range(4))
    pool.cache(a, b"a" * 16)
    pool.cache(b, b"b" * 16)
    # released in the order a, c, b, d: cached a and b queue at the back in that order,
    # uncached c and d jump to the front (the one released last first).
    pool.release([a, c, b, d])
    order = [pool.allocate().block_id for _ in range(4)]
    assert order == [d.block_id, c.block_id, a.block_id, b.block_id]


def test_allocating_a_cached_free_block_evicts_it():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.cache(block, b"h" * 16)
    pool.release([block])
    assert pool.lookup(b"h" * 16) is block  # still cached while free
    again = pool.allocate()
    assert again is block
    assert pool.lookup(b"h" * 16) is None
    assert block.block_hash is None
    assert pool.num_evictions == 1


def test_touching_a_cached_free_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, b"a" * 16)
    pool.release([a, b])
    pool.touch(a)
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    assert pool.allocate() is b
    assert pool.num_evictions == 0


def test_cache_keeps_the_first_block_registered_under_a_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, b"x" * 16)
    pool.cache(b, b"x" * 16)
    assert pool.lookup(b"x" * 16) is a
    assert b.block_hash is None
    assert pool.num_cached_blocks == 1


def test_reset_cache_forgets_only_blocks_nobody_holds():
    pool = BlockPool(3)
    held, free = pool.allocate(), pool.allocate()
    pool.cache(held, b"1" * 16)
    pool.cache(free, b"2" * 16)
    pool.release([free])
    assert pool.reset_cache() == 1
    assert pool.lookup(b"2" * 16) is None and free.block_hash is None
    assert pool.lookup(b"1" * 16) is held


def test_evictions_and_resets_are_logged_as_kv_events():
    from tandem.sched.kv_events import AllBlocksCleared, BlockRemoved, KVEventLog

    pool = BlockPool(4, events=KVEventLog())
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    for block, name in ((a, b"a"), (b, b"b"), (c, b"c")):
        assert pool.cache(block, name * 16)
    assert not pool.cache(c, b"d" * 16)                # already cached: not stored again
    pool.release([a, b])                               # c stays held
    pool.allocate()                                    # evicts a (released first)
    assert pool.events.take() == [BlockRemoved([b"a" * 16])]
    pool.reset_cache()                                 # c is held: only b goes, one by one
    assert pool.events.take() == [BlockRemoved([b"b" * 16])]
    pool.release([c])
    pool.reset_cache()
    assert pool.events.take() == [AllBlocksCleared()] and pool.events.take() == []
