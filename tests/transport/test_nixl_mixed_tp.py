"""The "nixl" connector reading from a tp=2 owner (two real owner processes, one per rank, over
UCX_TLS=tcp) into a tp=1 pool: one read per owner rank for one transfer, each of exactly that
rank's KV head; the oracle is the owners' own bytes. A transfer is reported once both of its
reads ended: a frozen rank makes it "error:deadline", then "closed" once it resumed and landed;
a killed rank makes it "error:peer"."""
from __future__ import annotations

import pytest
import torch

from tests.transport.kv_peer import SMALL, head_shards, make_connector, start_owner, wait_outcomes

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(120)
TCP = {"UCX_TLS": "tcp"}


@pytest.fixture
def owner_ranks(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    ranks = [start_owner(SMALL, seed=8, env=TCP, tp=2, rank=r) for r in range(2)]
    yield [process for process, _ in ranks], {**ranks[0][1], "ranks": [h for _, h in ranks]}
    for process, _ in ranks:
        if process.process.is_alive():
            process.thaw()
        process.stop()


@pytest.fixture
def reader():
    pool = torch.zeros(SMALL.shape)
    connector = make_connector(pool, shards=head_shards(SMALL, 1))
    yield connector, pool
    connector.close()


def _owners_blocks(processes, block_ids) -> torch.Tensor:
    return torch.cat([torch.from_numpy(p.ask("blocks", block_ids)) for p in processes], dim=4)


def _warm_peer(connector, handshake) -> str:
    """The owner added and one read done (its connections made)."""
    peer = connector.add_peer(handshake)
    connector.start_read("warm", peer, [1], [1], deadline_s=10.0)
    assert wait_outcomes(connector, ["warm"], 10.0) == {"warm": "done"}
    return peer


def test_a_tp1_rank_reads_each_head_from_the_owner_rank_that_holds_it(owner_ranks, reader):
    processes, handshake = owner_ranks
    connector, pool = reader
    peer = connector.add_peer(handshake)
    connector.start_read("mixed", peer, [3, 9, 5], [1, 2, 7], deadline_s=10.0)
    assert wait_outcomes(connector, ["mixed"], 10.0) == {"mixed": "done"}
    assert torch.equal(pool[[1, 2, 7]], _owners_blocks(processes, [3, 9, 5]))
    assert not pool[[0, 3, 4, 5, 6]].any()
    (counters,) = connector.read_counters()
    runs = SMALL.num_layers * 2 * SMALL.block_size  # per block and owner rank
    assert (counters.reads, counters.descriptors) == (1, 3 * 2 * runs)
    assert counters.bytes_read == 3 * runs * 2 * SMALL.head_dim * 4
    for process in processes:
        process.wait_notification("mixed")


def test_a_frozen_owner_rank_makes_the_transfer_late_then_closed(owner_ranks, reader):
    processes, handshake = owner_ranks
    connector, pool = reader
    peer = _warm_peer(connector, handshake)
    processes[1].freeze()
    connector.start_read("frozen", peer, [2, 3], [4, 5], deadline_s=1.0)
    assert wait_outcomes(connector, ["frozen"], 10.0) == {"frozen": "error:deadline"}
    assert connector.poll() == {}, "closed while an owner rank is still frozen"
    processes[1].thaw()
    assert wait_outcomes(connector, ["frozen"], 10.0) == {"frozen": "closed"}
    assert torch.equal(pool[[4, 5]], _owners_blocks(processes, [2, 3]))


def test_a_killed_owner_rank_ends_the_transfer_with_error_peer(owner_ranks, reader):
    processes, handshake = owner_ranks
    connector, _ = reader
    peer = _warm_peer(connector, handshake)
    processes[1].stop()
    connector.start_read("killed", peer, [2, 3], [4, 5], deadline_s=10.0)
    assert wait_outcomes(connector, ["killed"], 10.0) == {"killed": "error:peer"}
