"""The read plan between instances split differently, against hand-computed cases: which remote
rank each reading rank reads, the byte runs within a block, and who notifies whom."""
from __future__ import annotations

import pytest

from tandem.interfaces import KVShard
from tandem.transport.shard_plan import ShardPlanError, plan_rank


def shard(layers, heads, block_size=2, head_dim=1, itemsize=4) -> KVShard:
    return KVShard(*layers, *heads, block_size, head_dim, itemsize)


def test_a_rank_holding_half_the_heads_reads_every_run_of_them_from_a_whole_rank():
    # 2 layers, block_size 2, 4 heads of one float32: a block of the whole rank is
    # [2 layers][K, V][2 tokens][4 heads] = 16 runs of 16 bytes; the local rank holds heads 2-3:
    # run i (layer, K/V, token in order) is bytes 16 i + 8 .. 16 i + 16 there, 8 i .. 8 i + 8 here.
    whole = shard((0, 2), (0, 4))
    halves = [shard((0, 2), (0, 2)), shard((0, 2), (2, 4))]
    plan = plan_rank(halves, 1, [whole])
    (read,) = plan.reads
    assert read.remote_rank == 0 and read.run_bytes == 8
    assert read.segments.tolist() == [[8 * i, 16 * i + 8] for i in range(8)]
    assert plan.notify == {0: 2}  # both local ranks read remote rank 0
    assert (plan.descriptors_per_block, plan.bytes_per_block) == (8, 64)


def test_a_whole_rank_reads_each_half_from_the_rank_that_holds_it():
    whole = shard((0, 2), (0, 4))
    halves = [shard((0, 2), (0, 2)), shard((0, 2), (2, 4))]
    plan = plan_rank([whole], 0, halves)
    assert [r.remote_rank for r in plan.reads] == [0, 1]
    assert plan.reads[0].segments.tolist() == [[16 * i, 8 * i] for i in range(8)]
    assert plan.reads[1].segments.tolist() == [[16 * i + 8, 8 * i] for i in range(8)]
    assert plan.notify == {0: 1, 1: 1}
    assert plan.bytes_per_block == whole.block_bytes == 128


def test_pipeline_stages_are_one_contiguous_run_each():
    # 4 layers of [K, V][2 tokens][2 heads][head_dim 3] float32 = 96 bytes per layer, 192 a stage
    stages = [shard((0, 2), (0, 2), head_dim=3), shard((2, 4), (0, 2), head_dim=3)]
    whole = shard((0, 4), (0, 2), head_dim=3)
    plan = plan_rank([whole], 0, stages)
    assert [(r.remote_rank, r.segments.tolist(), r.run_bytes) for r in plan.reads] == [
        (0, [[0, 0]], 192), (1, [[192, 0]], 192)]
    reverse = plan_rank(stages, 1, [whole])
    assert [(r.remote_rank, r.segments.tolist(), r.run_bytes) for r in reverse.reads] == [(0, [[0, 192]], 192)]


def test_instances_split_alike_read_whole_blocks_rank_to_rank():
    ranks = [shard((0, 2), (0, 2)), shard((0, 2), (2, 4))]
    for rank in (0, 1):
        plan = plan_rank(ranks, rank, ranks)
        assert [(r.remote_rank, r.segments.tolist(), r.run_bytes) for r in plan.reads] == [
            (rank, [[0, 0]], ranks[rank].block_bytes)]
        assert plan.notify == {rank: 1}


def test_replicated_heads_are_read_from_one_copy_and_the_other_copy_is_notified():
    # one KV head replicated on both ranks of a tp=2 instance
    copies = [shard((0, 2), (0, 1)), shard((0, 2), (0, 1))]
    single = [shard((0, 2), (0, 1))]
    plan = plan_rank(single, 0, copies)
    assert [r.remote_rank for r in plan.reads] == [0]
    assert plan.notify == {0: 1, 1: 1}  # rank 1 is read by nobody: this rank tells it
    # a tp=2 reader of a tp=2 replicated owner: each rank reads its own copy
    assert [r.remote_rank for r in plan_rank(copies, 1, copies).reads] == [1]
    # two replicated readers of one owner: both read it, which expects two notifications
    both = [plan_rank(copies, r, single) for r in (0, 1)]
    assert all(p.notify == {0: 2} and p.bytes_per_block == single[0].block_bytes for p in both)


@pytest.mark.parametrize("remote, match", [
    ([shard((0, 1), (0, 4))], "do not hold every layer"),
    ([shard((0, 2), (0, 4), block_size=4)], "block_size 4"),
    ([shard((0, 2), (0, 4), head_dim=2)], "head_dim 2"),
    ([shard((0, 2), (0, 4), itemsize=2)], "itemsize 2"),
    ([shard((0, 2), (0, 3)), shard((0, 2), (2, 4))], "overlapping"),
])
def test_what_cannot_work_is_refused_with_the_reason(remote, match):
    with pytest.raises(ShardPlanError, match=match):
        plan_rank([shard((0, 2), (0, 4))], 0, remote)
