"""The "loopback" connector: the KVConnector contract in one process. Oracle: the owner's tensor."""
from __future__ import annotations

import random
import time

import pytest
import torch

from tandem.interfaces import KVPoolDescriptor, compat_hash
from tandem.transport.compat import KVHandshakeError
from tandem.transport.loopback import LoopbackConnector

pytestmark = pytest.mark.timeout(30)

SHAPE = (32, 2, 2, 4, 2, 8)  # [num_blocks, layers, K/V, block_size, kv_heads, head_dim]
COMPAT = compat_hash(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def connector_for(pool: torch.Tensor, compat: str = COMPAT) -> LoopbackConnector:
    connector = LoopbackConnector()
    connector.register_pool(pool, KVPoolDescriptor.for_pool(pool, compat))
    return connector


@pytest.fixture
def pair():
    owner_pool = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    reader_pool = torch.zeros(SHAPE)
    owner, reader = connector_for(owner_pool), connector_for(reader_pool)
    peer = reader.add_peer(owner.handshake_info())
    yield owner, owner_pool, reader, reader_pool, peer
    reader.close()
    owner.close()


def test_scattered_read_copies_exactly_the_owner_blocks(pair):
    owner, owner_pool, reader, reader_pool, peer = pair
    remote_ids, local_ids = [30, 2, 17, 9], [0, 31, 5, 12]
    reader.start_read("t", peer, remote_ids, local_ids, deadline_s=5.0)
    assert reader.poll() == {"t": "done"}
    assert torch.equal(reader_pool[local_ids], owner_pool[remote_ids])
    untouched = sorted(set(range(SHAPE[0])) - set(local_ids))
    assert not reader_pool[untouched].any()
    assert reader.poll() == {}


def test_owner_is_notified_of_reads_and_releases(pair):
    owner, _, reader, _, peer = pair
    reader.start_read("read", peer, [1], [1], deadline_s=5.0)
    reader.notify_release(peer, "skipped")
    assert owner.get_notifications() == ["read", "skipped"]
    assert owner.get_notifications() == []


def test_many_concurrent_reads(pair):
    owner, owner_pool, reader, reader_pool, peer = pair
    rng = random.Random(0)
    local = rng.sample(range(SHAPE[0]), SHAPE[0])
    reads = {f"c{i}": (rng.sample(range(SHAPE[0]), 2), local[2 * i:2 * i + 2]) for i in range(16)}
    for transfer_id, (remote_ids, local_ids) in reads.items():
        reader.start_read(transfer_id, peer, remote_ids, local_ids, deadline_s=5.0)
    assert reader.poll() == dict.fromkeys(reads, "done")
    for remote_ids, local_ids in reads.values():
        assert torch.equal(reader_pool[local_ids], owner_pool[remote_ids])
    assert sorted(owner.get_notifications()) == sorted(reads)


def test_a_bfloat16_pool_is_copied_bit_for_bit():
    owner_pool = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    reader_pool = torch.zeros(SHAPE, dtype=torch.bfloat16)
    owner, reader = connector_for(owner_pool), connector_for(reader_pool)
    reader.start_read("bf16", reader.add_peer(owner.handshake_info()), [3, 4], [8, 2], 5.0)
    assert reader.poll() == {"bf16": "done"}
    assert torch.equal(reader_pool[[8, 2]].view(torch.int16), owner_pool[[3, 4]].view(torch.int16))
    reader.close()
    owner.close()


def test_compat_mismatch_is_refused_at_add_peer():
    owner = connector_for(torch.zeros(SHAPE))
    other = compat_hash(model="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    reader = connector_for(torch.zeros(SHAPE), compat=other)
    with pytest.raises(KVHandshakeError, match="KV layout mismatch"):
        reader.add_peer(owner.handshake_info())
    reader.start_read("t", owner.agent_name, [0], [0], deadline_s=5.0)
    assert reader.poll() == {"t": "error:peer"}
    reader.close()
    owner.close()


def test_closed_owner_gives_error_peer(pair):
    owner, _, reader, _, peer = pair
    owner.close()
    reader.start_read("t", peer, [0], [0], deadline_s=5.0)
    assert reader.poll() == {"t": "error:peer"}


def test_paused_owner_gives_error_deadline_after_the_deadline(pair):
    owner, _, reader, reader_pool, peer = pair
    owner.pause()
    started = time.monotonic()
    reader.start_read("t", peer, [0], [0], deadline_s=0.2)
    assert reader.poll() == {}
    outcome = {}
    while not outcome:
        outcome = reader.poll()
    assert outcome == {"t": "error:deadline"}
    assert time.monotonic() - started >= 0.2
    assert not reader_pool.any()
    assert owner.get_notifications() == []


def test_resumed_owner_completes_a_pending_read(pair):
    owner, owner_pool, reader, reader_pool, peer = pair
    owner.pause()
    reader.start_read("t", peer, [6], [7], deadline_s=5.0)
    assert reader.poll() == {}
    owner.resume()
    assert reader.poll() == {"t": "done"}
    assert torch.equal(reader_pool[7], owner_pool[6])


def test_empty_read_is_done_and_notifies(pair):
    owner, _, reader, _, peer = pair
    reader.start_read("nothing", peer, [], [], deadline_s=5.0)
    assert reader.poll() == {"nothing": "done"}
    assert owner.get_notifications() == ["nothing"]


@pytest.mark.parametrize("remote_ids, local_ids, match", [
    ([0, 1], [0], "2 remote blocks but 1 local"),
    ([0, 1], [3, 3], "local block appears twice"),
    ([SHAPE[0]], [0], "remote block ids"),
    ([0], [SHAPE[0]], "local block ids"),
])
def test_malformed_reads_raise_value_error(pair, remote_ids, local_ids, match):
    _, _, reader, _, peer = pair
    with pytest.raises(ValueError, match=match):
        reader.start_read("bad", peer, remote_ids, local_ids, deadline_s=5.0)
    assert reader.poll() == {}


def test_an_unreported_transfer_id_cannot_be_reused(pair):
    _, _, reader, _, peer = pair
    reader.start_read("same", peer, [0], [0], deadline_s=5.0)
    with pytest.raises(ValueError, match="already in flight"):
        reader.start_read("same", peer, [1], [1], deadline_s=5.0)
    assert reader.poll() == {"same": "done"}
    reader.start_read("same", peer, [1], [1], deadline_s=5.0)
    assert reader.poll() == {"same": "done"}


def test_two_live_connectors_cannot_share_a_name():
    first = LoopbackConnector("twin")
    first.register_pool(pool := torch.zeros(SHAPE), KVPoolDescriptor.for_pool(pool, COMPAT))
    try:
        with pytest.raises(ValueError, match="already registered"):
            second = LoopbackConnector("twin")
            second.register_pool(other := torch.zeros(SHAPE), KVPoolDescriptor.for_pool(other, COMPAT))
    finally:
        first.close()
