"""PagedKVAllocator on hand-computed cases (block size 4 unless said otherwise).

The pool hands out blocks in id order from a fresh start; freed blocks that are not cached go to
the front of the free queue, cached ones to the back (released tail first)."""
from tandem.sched.kv_manager import PagedKVAllocator
from tandem.sched.request import Request
from tandem.sampling_params import SamplingParams


def make(rid, tokens, **params):
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(**params))


def compute(kv, request, num_new, num_cached=0):
    """Allocate like the scheduler does and mark the tokens computed (as after the forward pass)."""
    allocation = kv.allocate(request, num_new, num_cached)
    assert allocation is not None
    request.num_computed_tokens += num_cached + num_new
    return allocation


def refs(kv, *ids):
    return [kv.block_pool.blocks[i].ref_count for i in ids]


def test_first_allocation_covers_the_scheduled_tokens_only():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(10))
    allocation = compute(kv, a, 6)
    assert allocation.new_block_ids == [1, 2]
    assert kv.get_block_ids("a") == [1, 2]
    assert allocation.replaced_blocks == [] and allocation.block_copies == []


def test_table_grows_only_when_a_block_boundary_is_crossed():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(10))
    compute(kv, a, 10)
    a.append_output_token(50)
    a.append_output_token(51)
    assert kv.allocate(a, 1).new_block_ids == []  # token 10 fits block 3 (slots 8..11)
    a.num_computed_tokens = 11
    assert compute(kv, a, 1).new_block_ids == []  # token 11 is the last slot of block 3
    a.append_output_token(52)
    assert compute(kv, a, 1).new_block_ids == [4]  # token 12 opens a fourth block
    assert kv.get_block_ids("a") == [1, 2, 3, 4]


def test_failed_allocation_changes_nothing():
    kv = PagedKVAllocator(num_blocks=4, block_size=4)
    compute(kv, make("a", range(10)), 10)
    b = make("b", range(100, 105))
    assert kv.allocate(b, 5) is None
    assert kv.get_block_ids("b") == []
    assert kv.num_free_blocks() == 0
    assert kv.stats().num_used_blocks == 3


def test_stats_count_usable_blocks_without_the_null_block():
    kv = PagedKVAllocator(num_blocks=8, block_size=4)
    compute(kv, make("a", range(5)), 5)
    stats = kv.stats()
    assert (stats.num_blocks, stats.num_used_blocks, stats.num_free_blocks) == (7, 2, 5)
    assert stats.usage == 2 / 7


def test_prefix_hit_maps_onto_the_blocks_that_computed_the_prefix():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(10))
    compute(kv, a, 10)
    kv.free("a")  # a held [1, 2, 3]; 1 and 2 are full and computed, so cached
    b = make("b", [*range(8), 77, 78, 79])
    assert kv.get_num_cached_tokens(b) == 8
    allocation = compute(kv, b, 3, num_cached=8)
    # free queue after a's free: [3 (uncached, front), 4..9, 2, 1]: the fresh block is 3
    assert kv.get_block_ids("b") == [1, 2, 3]
    assert allocation.new_block_ids == [1, 2, 3]
    assert refs(kv, 1, 2, 3) == [1, 1, 1]


def test_a_hit_stops_at_the_first_block_that_differs():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(12))
    compute(kv, a, 12)
    kv.free("a")
    b = make("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    assert kv.get_num_cached_tokens(b) == 4


def test_equal_blocks_behind_different_prefixes_do_not_hit():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", [9, 9, 9, 9, 1, 2, 3, 4, 5])
    compute(kv, a, 9)
    kv.free("a")
    b = make("b", [8, 8, 8, 8, 1, 2, 3, 4, 5])
    assert kv.get_num_cached_tokens(b) == 0


def test_the_last_token_is_always_recomputed():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(9))
    compute(kv, a, 9)
    kv.free("a")
    assert kv.get_num_cached_tokens(make("b", range(8))) == 4
    assert kv.get_num_cached_tokens(make("c", range(9))) == 8


def test_prompt_logprobs_and_disabled_caching_never_hit_and_count_no_query():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(9))
    compute(kv, a, 9)
    kv.free("a")
    assert kv.get_num_cached_tokens(make("b", range(9), prompt_logprobs=0)) == 0
    assert kv.stats().prefix_cache_queries == 0
    off = PagedKVAllocator(num_blocks=10, block_size=4, enable_prefix_caching=False)
    c = make("c", range(9))
    compute(off, c, 9)
    off.free("c")
    assert off.get_num_cached_tokens(make("d", range(9))) == 0
    assert off.block_pool.num_cached_blocks == 0


def test_queries_and_hits_are_counted_in_tokens():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(9))
    assert kv.get_num_cached_tokens(a) == 0
    compute(kv, a, 9)
    kv.free("a")
    assert kv.get_num_cached_tokens(make("b", [*range(8), 5, 5])) == 8
    stats = kv.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 10, 8)


def test_blocks_are_cached_only_once_their_tokens_are_computed():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(9))
    assert kv.allocate(a, 9) is not None  # scheduled, not yet computed
    assert kv.get_num_cached_tokens(make("b", range(9))) == 0
    a.num_computed_tokens = 9  # the forward pass ran
    a.append_output_token(40)
    compute(kv, a, 1)  # the next allocation registers what is computed: blocks 1 and 2
    assert kv.get_num_cached_tokens(make("c", range(9))) == 8


def test_free_registers_computed_blocks_and_skips_uncomputed_ones():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(9))
    kv.allocate(a, 9)
    a.num_computed_tokens = 4  # only the first block's tokens were computed
    kv.free("a")
    assert kv.get_num_cached_tokens(make("b", range(9))) == 4


def test_freed_prefixes_are_evicted_tail_first():
    kv = PagedKVAllocator(num_blocks=5, block_size=4)
    a = make("a", range(12))
    compute(kv, a, 12)
    kv.free("a")  # free queue: [4, 3, 2, 1] (4 never used; then a's blocks, tail first)
    c = make("c", range(100, 108))
    compute(kv, c, 8)
    assert kv.get_block_ids("c") == [4, 3]
    assert kv.block_pool.num_evictions == 1
    assert kv.get_num_cached_tokens(make("d", [*range(12), 0])) == 8  # blocks 1 and 2 survive


def test_a_cache_hit_revives_a_free_block_and_evicts_another():
    kv = PagedKVAllocator(num_blocks=3, block_size=4)
    a = make("a", range(8))
    compute(kv, a, 8)
    kv.free("a")  # free queue: [2, 1], both cached
    b = make("b", [0, 1, 2, 3, 9, 9])
    assert kv.get_num_cached_tokens(b) == 4
    compute(kv, b, 2, num_cached=4)  # 1 revived + 1 fresh = the 2 usable blocks
    assert kv.get_block_ids("b") == [1, 2]
    assert kv.block_pool.num_evictions == 1
    assert kv.num_free_blocks() == 0


def test_revived_blocks_and_fresh_ones_must_fit_together():
    kv = PagedKVAllocator(num_blocks=3, block_size=4)
    a = make("a", range(8))
    compute(kv, a, 8)
    kv.free("a")
    b = make("b", [*range(8), 1, 2, 3])
    assert kv.get_num_cached_tokens(b) == 8
    assert kv.allocate(b, 3, 8) is None  # 2 revived + 1 fresh > 2 usable
    assert refs(kv, 1, 2) == [0, 0]
    assert kv.num_free_blocks() == 2


def test_fork_shares_every_block():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(6))
    compute(kv, a, 6)
    kv.fork("a", "a#1")
    assert kv.get_block_ids("a#1") == [1, 2]
    assert refs(kv, 1, 2) == [2, 2]
    assert kv.stats().num_used_blocks == 2


def test_writing_into_a_shared_partial_block_copies_it_first():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(6))
    compute(kv, a, 6)
    kv.fork("a", "a#1")
    child = a.fork("a#1", 1)
    child.append_output_token(70)
    allocation = compute(kv, child, 1)
    assert allocation.block_copies == [(2, 3)]
    assert allocation.replaced_blocks == [(1, 3)]
    assert allocation.new_block_ids == []
    assert kv.get_block_ids("a#1") == [1, 3]
    assert refs(kv, 1, 2, 3) == [2, 1, 1]
    a.append_output_token(71)
    parent = compute(kv, a, 1)  # the parent is now the only holder of block 2: no copy
    assert parent.block_copies == [] and kv.get_block_ids("a") == [1, 2]


def test_full_shared_blocks_are_never_copied():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(8))
    compute(kv, a, 8)
    kv.fork("a", "a#1")
    child = a.fork("a#1", 1)
    child.append_output_token(70)
    allocation = compute(kv, child, 1)
    assert allocation.block_copies == [] and allocation.new_block_ids == [3]
    assert kv.get_block_ids("a#1") == [1, 2, 3]


def test_copy_on_write_fails_cleanly_without_a_free_block():
    kv = PagedKVAllocator(num_blocks=4, block_size=4)
    a = make("a", range(6))
    compute(kv, a, 6)
    kv.fork("a", "a#1")
    child = a.fork("a#1", 1)
    child.append_output_token(70)
    compute(kv, make("x", [1]), 1)  # takes the last free block
    assert kv.allocate(child, 1) is None
    assert kv.get_block_ids("a#1") == [1, 2] and refs(kv, 1, 2) == [2, 2]


def test_free_releases_each_reference_once():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(6))
    compute(kv, a, 6)
    kv.fork("a", "a#1")
    kv.free("a")
    kv.free("a")  # a second free is a no-op
    kv.free("never-seen")
    assert refs(kv, 1, 2) == [1, 1]
    kv.free("a#1")
    assert refs(kv, 1, 2) == [0, 0]
    assert kv.num_free_blocks() == 9


def test_reset_prefix_cache_forgets_free_cached_blocks():
    kv = PagedKVAllocator(num_blocks=10, block_size=4)
    a = make("a", range(9))
    compute(kv, a, 9)
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.get_num_cached_tokens(make("b", range(9))) == 0


def test_cache_salt_separates_prefixes():
    kv = PagedKVAllocator(num_blocks=16, block_size=4)
    a = make("a", range(10))
    a.cache_salt = "tenant-1"
    compute(kv, a, 10)
    kv.free("a")
    same = make("b", range(10))
    same.cache_salt = "tenant-1"
    other = make("c", range(10))
    other.cache_salt = "tenant-2"
    unsalted = make("d", range(10))
    assert kv.get_num_cached_tokens(same) == 8
    assert kv.get_num_cached_tokens(other) == 0
    assert kv.get_num_cached_tokens(unsalted) == 0


def test_blocks_entering_the_cache_are_logged_in_runs_with_their_parent_and_tokens():
    from tandem.sched.block_pool import hash_block_tokens
    from tandem.sched.kv_events import BlockStored

    kv = PagedKVAllocator(num_blocks=16, block_size=2)
    kv.record_events()
    tokens = [1, 2, 3, 4, 5, 6, 7]
    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    h3 = hash_block_tokens(h2, [5, 6])
    first = make("a", tokens[:4] + [9])
    compute(kv, first, 5)
    kv.free("a")
    assert kv.take_events() == [BlockStored([h1, h2], None, [1, 2, 3, 4], 2)]
    second = make("b", tokens)                         # hits [1 2][3 4], computes the rest
    compute(kv, second, 3, num_cached=4)
    kv.free("b")
    assert kv.take_events() == [BlockStored([h3], h2, [5, 6], 2)]
