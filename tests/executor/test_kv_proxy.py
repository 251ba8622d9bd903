"""``RankedConnector`` over real loopback connectors, one per rank of each instance: every rank of
the reader ends with exactly its layers and KV heads of the owner's blocks — whatever the two
instances' splits (tp 2 ↔ 1, pp 2 → 1, a replicated KV head) — a transfer is "done" only when
every rank's read is, a read one rank's frozen owner holds past its deadline is "error:deadline"
and then "closed" once it lands, and an owner hears of a transfer once every reader of each of
its ranks released it. The oracle is one tensor of the whole model's KV, sliced by hand."""
from __future__ import annotations

import time

import pytest
import torch

from tandem.config import load_config
from tandem.executor import kv_proxy
from tandem.executor.kv_proxy import RankedConnector
from tandem.interfaces import KVPoolDescriptor
from tandem.models.config import ModelArchConfig, kv_shards
from tandem.transport.faulty import FaultyConnector
from tandem.transport.loopback import LoopbackConnector

BLOCKS, LAYERS, BLOCK_SIZE, HEAD_DIM = 6, 4, 2, 3


def _arch(kv_heads: int) -> ModelArchConfig:
    return ModelArchConfig(architectures=("LlamaForCausalLM",), model_type="llama", hidden_size=8 * HEAD_DIM,
                           intermediate_size=8, num_hidden_layers=LAYERS, num_attention_heads=8,
                           num_key_value_heads=kv_heads, head_dim=HEAD_DIM, vocab_size=16, rms_norm_eps=1e-6,
                           rope_theta=1e4, rope_scaling=None, max_position_embeddings=64)


def _instance(whole: torch.Tensor | None, tp: int, pp: int, kv_heads: int = 4):
    """Connectors of a tp × pp instance; each rank's pool is its slice of ``whole`` (zeros: None)."""
    shards = kv_shards(_arch(kv_heads), BLOCK_SIZE, torch.float32, tp, pp)
    connectors, pools = [], []
    for rank, s in enumerate(shards):
        shape = (BLOCKS, s.num_layers, 2, BLOCK_SIZE, s.num_heads, HEAD_DIM)
        pool = torch.zeros(shape) if whole is None else \
            whole[:, s.layer_start:s.layer_stop, :, :, s.head_start:s.head_stop].contiguous()
        c = LoopbackConnector()
        c.register_pool(pool, KVPoolDescriptor.for_pool(pool, "hash", shards, rank))
        connectors.append(c)
        pools.append(pool)

    def call(method, args):
        return [getattr(c, method)(*a) for c, a in zip(connectors, args)]

    proxy = RankedConnector(call, [c.handshake_info() for c in connectors], tp, pp)
    return proxy, connectors, pools, shards


def _whole(seed: float, kv_heads: int = 4) -> torch.Tensor:
    return torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, kv_heads, HEAD_DIM,
                       generator=torch.Generator().manual_seed(int(seed)))


def _poll_until(proxy, tid, seconds=2.0):
    deadline, seen = time.monotonic() + seconds, {}
    while tid not in seen and time.monotonic() < deadline:
        seen.update(proxy.poll())
        time.sleep(0.01)
    return seen.get(tid)


@pytest.mark.parametrize("owner_split, reader_split, kv_heads", [
    ((2, 1), (2, 1), 4), ((2, 1), (1, 1), 4), ((1, 1), (2, 1), 4), ((1, 2), (1, 1), 4),
    ((2, 2), (1, 2), 4), ((2, 1), (1, 1), 1), ((1, 1), (2, 1), 1),
])
def test_every_reader_rank_gets_exactly_its_layers_and_heads(owner_split, reader_split, kv_heads):
    whole = _whole(10, kv_heads)
    owner, _, _, _ = _instance(whole, *owner_split, kv_heads)
    reader, _, reader_pools, shards = _instance(None, *reader_split, kv_heads)
    peer = reader.add_peer(owner.handshake_info())
    reader.start_read("t1", peer, [1, 2], [4, 5], deadline_s=5)
    assert _poll_until(reader, "t1") == "done"
    for pool, s in zip(reader_pools, shards):
        expected = whole[[1, 2], s.layer_start:s.layer_stop, :, :, s.head_start:s.head_stop]
        assert torch.equal(pool[4:6], expected)
        assert not pool[:4].any()
    for counters, s in zip(reader.read_counters(), shards):
        assert counters.bytes_read == 2 * s.block_bytes  # exactly its own KV of the two blocks
    assert owner.get_notifications() == ["t1"]
    assert owner.get_notifications() == []


def test_an_owner_read_by_two_ranks_hears_of_the_transfer_only_when_both_released():
    owner, owner_ranks, _, _ = _instance(_whole(3), 1, 1)
    reader, reader_ranks, _, _ = _instance(None, 2, 1)
    peer = reader.add_peer(owner.handshake_info())
    reader_ranks[0].notify_release(peer, "t3")
    assert owner.get_notifications() == []  # one of its two readers is not done
    reader_ranks[1].notify_release(peer, "t3")
    assert owner.get_notifications() == ["t3"]


def test_one_frozen_owner_rank_makes_the_transfer_late_then_closed():
    whole = _whole(20)
    owner, owner_ranks, owner_pools, _ = _instance(whole, 2, 1)
    reader, _, reader_pools, _ = _instance(None, 2, 1)
    peer = reader.add_peer(owner.handshake_info())
    owner_ranks[1].pause()
    reader.start_read("t2", peer, [3], [1], deadline_s=0.05)
    assert _poll_until(reader, "t2") == "error:deadline"
    assert reader.poll() == {}  # not the caller's yet: rank 1's read may still land
    owner_ranks[1].resume()
    assert _poll_until(reader, "t2") == "closed"
    assert torch.equal(reader_pools[1][1], owner_pools[1][3])


def test_a_peer_of_another_model_is_refused_naming_the_shard():
    reader, _, _, _ = _instance(None, 2, 1)
    fewer_layers = torch.zeros(BLOCKS, LAYERS - 1, 2, BLOCK_SIZE, 4, HEAD_DIM)
    single = LoopbackConnector()
    single.register_pool(fewer_layers, KVPoolDescriptor.for_pool(fewer_layers, "hash"))
    with pytest.raises(ValueError, match=r"do not hold every layer and KV head of rank 0's shard"):
        reader.add_peer(single.handshake_info())


def _faulty_instance(whole: torch.Tensor, tp: int, **faults):
    """A tp-way instance whose ranks' connectors are "faulty" over loopback ones."""
    config = load_config(overrides={"fault_injection.inner_connector": "loopback",
                                    **{f"fault_injection.{k}": v for k, v in faults.items()}}, env={})
    shards = kv_shards(_arch(4), BLOCK_SIZE, torch.float32, tp, 1)
    connectors = []
    for rank, s in enumerate(shards):
        pool = whole[:, :, :, :, s.head_start:s.head_stop].contiguous()
        c = FaultyConnector()
        c.configure(config)
        c.register_pool(pool, KVPoolDescriptor.for_pool(pool, "hash", shards, rank))
        connectors.append(c)

    def call(method, args):
        return [getattr(c, method)(*a) for c, a in zip(connectors, args)]

    return RankedConnector(call, [c.handshake_info() for c in connectors], tp, 1)


def test_the_handshake_follows_a_rank_whose_transport_restarted(monkeypatch):
    """An owner's rank restarted its transport (a new agent): within HANDSHAKE_REFRESH_S the
    instance serves the new handshake, and a reader that adds it reads again. The block
    checksums of the reader's copy, a tp=1 pool, equal the sum of the owner ranks' shares."""
    monkeypatch.setattr(kv_proxy, "HANDSHAKE_REFRESH_S", 0.0)
    whole = _whole(7)
    owner = _faulty_instance(whole, 2, restart_every_n=1)
    reader, _, (reader_pool,), _ = _instance(None, 1, 1)
    old = owner.handshake_info()
    reader.start_read("t1", reader.add_peer(old), [1], [2], 5.0)
    assert _poll_until(reader, "t1") == "done"
    assert owner.get_notifications() == ["t1"]  # heard by both ranks: each restarts
    owner.get_notifications()
    new = owner.handshake_info()
    assert [r["agent_name"] for r in new["ranks"]] != [r["agent_name"] for r in old["ranks"]]
    reader.start_read("t2", reader.add_peer(old), [3], [4], 5.0)
    assert _poll_until(reader, "t2") == "error:peer"
    reader.start_read("t3", reader.add_peer(new), [3], [4], 5.0)
    assert _poll_until(reader, "t3") == "done"
    assert torch.equal(reader_pool[4], whole[3])
    assert reader.block_checksums([2, 4]) == owner.block_checksums([1, 3])


def test_a_read_from_a_peer_removed_meanwhile_ends_as_error_peer():
    """A load admitted before its peer was removed (another load found it dead) starts its read
    after: it ends "error:peer", as on a single-rank connector — not as a refused call."""
    owner, _, _, _ = _instance(_whole(5), 1, 1)
    reader, ranks, _, _ = _instance(None, 2, 1)
    for connector in (reader, ranks[0]):
        peer = connector.add_peer(owner.handshake_info())
        connector.remove_peer(peer)
        connector.start_read("t", peer, [1], [2], 5.0)
        assert connector.poll() == {"t": "error:peer"}
