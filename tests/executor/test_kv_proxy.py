"""``RankedConnector`` over real loopback connectors, one per rank of each instance: rank r's
blocks land in rank r's pool, a transfer is "done" only when every rank's read is, a read one
rank's frozen owner holds past its deadline is "error:deadline" and then "closed" once it lands,
and an owner hears of a transfer once every rank's reader has released it."""
from __future__ import annotations

import torch

from tandem.executor.kv_proxy import RankedConnector
from tandem.interfaces import KVPoolDescriptor
from tandem.transport.loopback import LoopbackConnector

RANKS, BLOCKS = 2, 6


def _instance(fill: float):
    connectors, pools = [], []
    for rank in range(RANKS):
        pool = torch.full((BLOCKS, 2, 4), fill + rank) if fill else torch.zeros(BLOCKS, 2, 4)
        pool[0] = 0
        c = LoopbackConnector()
        c.register_pool(pool, KVPoolDescriptor.for_pool(pool, "hash"))
        connectors.append(c)
        pools.append(pool)

    def call(method, args):
        return [getattr(c, method)(*a) for c, a in zip(connectors, args)]

    proxy = RankedConnector(call, [c.handshake_info() for c in connectors], RANKS, 1)
    return proxy, connectors, pools


def _poll_until(proxy, tid, seconds=2.0):
    import time

    deadline, seen = time.monotonic() + seconds, {}
    while tid not in seen and time.monotonic() < deadline:
        seen.update(proxy.poll())
        time.sleep(0.01)
    return seen.get(tid)


def test_every_rank_reads_its_own_slice_and_the_owner_hears_once():
    owner, _, owner_pools = _instance(10.0)
    reader, _, reader_pools = _instance(0.0)
    peer = reader.add_peer(owner.handshake_info())
    reader.start_read("t1", peer, [1, 2], [4, 5], deadline_s=5)
    assert _poll_until(reader, "t1") == "done"
    for rank in range(RANKS):
        assert torch.equal(reader_pools[rank][4:6], owner_pools[rank][1:3])
        assert reader_pools[rank][4, 0, 0] == 10.0 + rank
    assert owner.get_notifications() == ["t1"]
    assert owner.get_notifications() == []


def test_one_frozen_owner_rank_makes_the_transfer_late_then_closed():
    owner, owner_ranks, owner_pools = _instance(20.0)
    reader, _, reader_pools = _instance(0.0)
    peer = reader.add_peer(owner.handshake_info())
    owner_ranks[1].pause()
    reader.start_read("t2", peer, [3], [1], deadline_s=0.05)
    assert _poll_until(reader, "t2") == "error:deadline"
    assert reader.poll() == {}  # not the caller's yet: rank 1's read may still land
    owner_ranks[1].resume()
    assert _poll_until(reader, "t2") == "closed"
    assert torch.equal(reader_pools[1][1], owner_pools[1][3])


def test_a_peer_split_another_way_is_refused():
    reader, _, _ = _instance(0.0)
    single = LoopbackConnector()
    pool = torch.zeros(BLOCKS, 2, 4)
    single.register_pool(pool, KVPoolDescriptor.for_pool(pool, "hash"))
    import pytest

    with pytest.raises(ValueError, match="1 × 1, this instance 2 × 1"):
        reader.add_peer(single.handshake_info())
