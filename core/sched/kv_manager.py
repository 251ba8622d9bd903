"""The paged KV allocator: a block table per request over a ``BlockPool``, with prefix caching,
fork and copy-on-write. Pure Python.

A request's tokens map onto its block table (block size 4 here)::

    tokens       t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    logical      0           | 1           | 2
    table        [17,          5,            9]     physical block ids

Prefix caching works on FULL blocks: block ``i`` is keyed by the chained hash of tokens
``0 .. (i+1)*block_size - 1``. A block is registered in the cache once its KV is computed, which
the allocator learns from the request's ``num_computed_tokens``: at the request's next
``allocate`` (tokens computed before this step) and at ``free`` (everything computed). So a
prefix hit only ever lands on KV a finished forward pass wrote, even when the scheduler undoes an
allocation of the current step (a preemption) — see ``allocate``.

After ``fork`` parent and child share every block; the first of them to write into a shared
block (the partial last one; full blocks are never written again) gets a private copy::

    parent [17, 5, 9]  child [17, 5, 9]     9 holds t8 t9, ref_count 2
    child writes t10 → child [17, 5, 12], block_copies [(9, 12)], replaced_blocks [(2, 12)]
"""
from __future__ import annotations

from collections import Counter

from tandem.interfaces import KVAllocation, KVAllocator, KVStats, SchedulableRequest
from tandem.sched.block_pool import BlockPool, KVBlock, extend_chain
from tandem.sched.kv_events import BlockStored, KVCacheEvent, KVEventLog


class PagedKVAllocator(KVAllocator):
    """The built-in allocator ("paged"). Driven by the Scheduler on the engine thread only."""

    name = "paged"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.block_pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}
        self._requests: dict[str, SchedulableRequest] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_registered: dict[str, int] = {}
        self._queries = 0
        self._hits = 0

    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_num_cached_tokens(self, request: SchedulableRequest) -> int:
        """The longest run of leading full blocks found in the cache, in tokens; at most
        ``num_tokens - 1`` rounded down to a block. 0 (and no query counted) when caching is off
        or the request wants prompt logprobs (they need every prompt position computed)."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        num_hit = 0
        for block_hash in self._block_hashes(request, max_blocks)[:max_blocks]:
            if self.block_pool.lookup(block_hash) is None:
                break
            num_hit += 1
        self._queries += request.num_tokens
        self._hits += num_hit * self.block_size
        return num_hit * self.block_size

    def allocate(
        self, request: SchedulableRequest, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> KVAllocation | None:
        """Attach ``num_cached_tokens`` of cached blocks (first allocation only), copy on write
        every shared block the new tokens land in, and append fresh blocks until the table covers
        ``num_computed_tokens + num_cached_tokens + num_new_tokens``. All or nothing: None when
        the free queue cannot supply the fresh blocks, the copies and the revived cached blocks.

        ``new_block_ids`` lists every block appended (cache hits first). Blocks full within the
        tokens computed before this call are registered in the prefix cache; this call's new
        tokens are not, as the scheduler may still undo this allocation in the same step."""
        rid = request.request_id
        bs = self.block_size
        table = self._tables.get(rid, [])
        assert num_cached_tokens % bs == 0 and not (num_cached_tokens and table)
        # no lookup without cached tokens (a running request's next tokens, most calls)
        hits = self._lookup_blocks(request, num_cached_tokens // bs) if num_cached_tokens else []
        start = request.num_computed_tokens + num_cached_tokens
        num_blocks_after = self.blocks_for(start + num_new_tokens)
        written = range(start // bs, min(len(table), num_blocks_after))
        shared = [i for i in written if table[i].ref_count > 1]
        num_fresh = max(0, num_blocks_after - len(table) - len(hits))
        num_revived = sum(1 for b in hits if b.ref_count == 0)
        if num_fresh + len(shared) + num_revived > self.block_pool.num_free_blocks:
            return None

        table = self._tables.setdefault(rid, [])
        self._requests[rid] = request
        for block in hits:
            self.block_pool.touch(block)
        allocation = KVAllocation()
        for index in shared:
            self._copy_on_write(table, index, allocation)
        appended = hits + [self.block_pool.allocate() for _ in range(num_fresh)]
        table.extend(appended)
        allocation.new_block_ids = [b.block_id for b in appended]
        self._register_computed(rid, start)
        return allocation

    def free(self, request_id: str) -> None:
        """Register the request's computed full blocks, then drop one reference of each of its
        blocks, tail first: the ends of prefixes are evicted before their starts."""
        table = self._tables.get(request_id)
        if table is not None:
            request = self._requests.get(request_id)
            if request is not None:
                self._register_computed(request_id, request.num_computed_tokens)
            self.block_pool.release(reversed(table))
        for state in (self._tables, self._requests, self._hashes, self._num_registered):
            state.pop(request_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        table = self._tables[parent_id]
        assert child_id not in self._tables, f"fork target {child_id} already holds blocks"
        for block in table:
            self.block_pool.touch(block)
        self._tables[child_id] = list(table)
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def stats(self) -> KVStats:
        num_free = self.block_pool.num_free_blocks
        return KVStats(
            num_blocks=self.num_usable_blocks,
            num_used_blocks=self.num_usable_blocks - num_free,
            num_free_blocks=num_free,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_cache()

    def record_events(self) -> None:
        self.block_pool.events = KVEventLog()

    def take_events(self) -> list[KVCacheEvent]:
        log = self.block_pool.events
        return [] if log is None else log.take()

    def check_consistency(self) -> None:
        holders = Counter(block.block_id for table in self._tables.values() for block in table)
        self.block_pool.check_consistency(holders)

    def _lookup_blocks(self, request: SchedulableRequest, num_blocks: int) -> list[KVBlock]:
        hashes = self._block_hashes(request, num_blocks)[:num_blocks]
        blocks = [self.block_pool.lookup(h) for h in hashes]
        assert all(b is not None for b in blocks), "cached blocks evicted between lookup and allocate"
        return blocks  # type: ignore[return-value]

    def _copy_on_write(self, table: list[KVBlock], index: int, allocation: KVAllocation) -> None:
        old = table[index]
        new = self.block_pool.allocate()
        allocation.block_copies.append((old.block_id, new.block_id))
        allocation.replaced_blocks.append((index, new.block_id))
        self.block_pool.release([old])
        table[index] = new

    def _register_computed(self, request_id: str, num_computed_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        done = self._num_registered.get(request_id, 0)
        if num_full <= done:
            return
        table = self._tables[request_id]
        request = self._requests[request_id]
        hashes = self._block_hashes(request, num_full)
        entered = [i for i in range(done, num_full) if self.block_pool.cache(table[i], hashes[i])]
        self._num_registered[request_id] = num_full
        if self.block_pool.events is not None and entered:
            self._log_stored(request, hashes, entered)

    def _log_stored(self, request: SchedulableRequest, hashes: list[bytes], entered: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive block indices that entered the cache."""
        bs = self.block_size
        tokens = request.all_token_ids
        runs: list[list[int]] = []
        for index in entered:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.block_pool.events.stored(BlockStored(
                block_hashes=hashes[first:end],
                parent_block_hash=hashes[first - 1] if first else None,
                token_ids=list(tokens[first * bs:end * bs]), block_size=bs))

    def _block_hashes(self, request: SchedulableRequest, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (memoized per
        request: the tokens under a full block never change)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        return extend_chain(hashes, request.all_token_ids, self.block_size, num_blocks,
                            getattr(request, "cache_salt", None))
