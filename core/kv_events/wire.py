"""The msgpack encoding of KV events, as vLLM's publishers send them and its consumers (llm-d's
indexer, Dynamo's KV router, vLLM's own subscriber example) decode them.

A batch is a msgpack array ``[ts, events, data_parallel_rank]``; each event a msgpack map whose
first key ``"type"`` names it (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
followed by its fields in declaration order, optional fields left out while they hold their
default::

    BlockStored       type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                      medium, lora_name
    BlockRemoved      type, block_hashes, medium
    AllBlocksCleared  type

Block hashes are tandem's own 16-byte chained hashes (msgpack bin), which vLLM's
``ExternalBlockHash`` (bytes or int) admits. tests/kv_events/test_vllm_wire.py decodes these
bytes with the struct definitions of a released vLLM wheel, so a change on either side fails.
The structs below also decode what vLLM itself publishes: fields tandem does not write
(``extra_keys``, ``group_idx``, ...) are skipped on decode.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from tandem.sched import kv_events as sched


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: sched.KVCacheEvent, medium: str) -> KVCacheEvent:
    """The wire struct of one event the block pool logged."""
    if isinstance(event, sched.BlockStored):
        return BlockStored(block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
                           token_ids=list(event.token_ids), block_size=event.block_size,
                           lora_id=None, medium=medium, lora_name=None)
    if isinstance(event, sched.BlockRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=medium)
    assert isinstance(event, sched.AllBlocksCleared), f"not a KV cache event: {event!r}"
    return AllBlocksCleared()


class BatchEncoder:
    """Encodes one step's events into one ``KVEventBatch`` payload."""

    def __init__(self, medium: str, data_parallel_rank: int = 0) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self.medium = medium
        self.data_parallel_rank = data_parallel_rank

    def encode(self, ts: float, events: Sequence[sched.KVCacheEvent]) -> bytes:
        batch = KVEventBatch(ts=ts, events=[to_wire(e, self.medium) for e in events],
                             data_parallel_rank=self.data_parallel_rank)
        return self._encoder.encode(batch)


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """One payload as a ``KVEventBatch``; ``msgspec.DecodeError`` (a ``ValueError``) when it is
    not one."""
    return _DECODER.decode(payload)
