"""Checksums of KV blocks that do not depend on how an instance is split.

A hand-over's KV may be written by a prefill instance split one way (tp=2, pp=2) and read by a
decode instance split another: the bytes of one block lie in different pools on the two sides.
The checksum of a block is therefore defined over the model's whole block, in its canonical
coordinates, and each rank adds what it holds::

    checksum(block) = sum over every (layer, kv, token, head, dim) cell of the model's block of
                      bits(x) * weight(canonical index)          (mod 2**32)

    canonical index = (((layer * 2 + kv) * block_size + token) * num_kv_heads + head) * head_dim + dim
    bits(x)         = the element's bytes as an unsigned integer of its width (8, 16 or 32 bits)
    weight(i)       = splitmix64(i) mod 2**32

A rank sums the cells of its shard (``KVShard``) that no lower rank also holds (a KV head
replicated across ranks counts once); the ranks' sums add up, mod 2**32, to the block's
checksum. It detects a read that delivered part of a block, or another block's bytes; it is not a
MAC (the hand-over's signature and the prompt digest are).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tandem.interfaces import KVPoolDescriptor, KVShard

MASK = (1 << 32) - 1
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def splitmix64(index: np.ndarray) -> np.ndarray:
    """SplitMix64's output function of ``index`` (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def shard_weights(descriptor: KVPoolDescriptor) -> np.ndarray:
    """The weight of each element of one block of this rank's pool, ``[layers, 2, block_size,
    heads, head_dim]`` uint32, 0 for cells a lower rank also holds."""
    shard = descriptor.shard
    if shard is None:
        raise ValueError("the pool's layout is not known: no KV shard in its descriptor")
    num_heads = max(s.head_stop for s in descriptor.shards)
    layers = np.arange(shard.layer_start, shard.layer_stop, dtype=np.uint64)
    heads = np.arange(shard.head_start, shard.head_stop, dtype=np.uint64)
    kv = np.arange(2, dtype=np.uint64)
    tokens = np.arange(shard.block_size, dtype=np.uint64)
    dims = np.arange(shard.head_dim, dtype=np.uint64)
    index = ((((layers[:, None, None, None, None] * 2 + kv[None, :, None, None, None]) * shard.block_size
               + tokens[None, None, :, None, None]) * num_heads + heads[None, None, None, :, None])
             * shard.head_dim + dims[None, None, None, None, :])
    weights = (splitmix64(index) & np.uint64(MASK)).astype(np.uint32)
    for lower in descriptor.shards[:descriptor.rank]:
        _zero_overlap(weights, shard, lower)
    return weights


def _zero_overlap(weights: np.ndarray, shard: KVShard, lower: KVShard) -> None:
    l0, l1 = max(shard.layer_start, lower.layer_start), min(shard.layer_stop, lower.layer_stop)
    h0, h1 = max(shard.head_start, lower.head_start), min(shard.head_stop, lower.head_stop)
    if l0 < l1 and h0 < h1:
        weights[l0 - shard.layer_start:l1 - shard.layer_start, :, :,
                h0 - shard.head_start:h1 - shard.head_start, :] = 0


class BlockChecksums:
    """This rank's share of block checksums over ``pool`` (``[num_blocks, ...]``, contiguous,
    described by ``descriptor``): ``of(block_ids)`` → one unsigned 32-bit int per block. On the
    CPU a numpy unsigned matrix-vector product (wrapping, as the definition wants); on a GPU
    torch integer ops."""

    def __init__(self, pool: Any, descriptor: KVPoolDescriptor) -> None:
        shard = descriptor.shard
        width = _UINT_OF_WIDTH.get(shard.itemsize) if shard is not None else None
        if width is None:
            raise ValueError(f"cannot checksum KV elements of {shard.itemsize if shard else '?'} bytes")
        import torch

        self._pool = pool
        self._rows = descriptor.num_blocks
        self._weights = shard_weights(descriptor).reshape(-1)
        self._device_weights = None
        self._host = None
        if pool.device.type == "cpu":  # a live unsigned view of the pool's bytes, any dtype
            signed = pool.view(-1).view(getattr(torch, f"int{8 * shard.itemsize}"))
            self._host = signed.numpy().view(width).reshape(self._rows, -1)

    def of(self, block_ids: list[int]) -> list[int]:
        if not block_ids:
            return []
        return self._of_host(block_ids) if self._pool.device.type == "cpu" else self._of_device(block_ids)

    def _of_host(self, block_ids: list[int]) -> list[int]:
        rows = self._host[block_ids]
        return [int(v) for v in rows.astype(np.uint32, copy=False) @ self._weights]  # wraps mod 2**32

    def _of_device(self, block_ids: list[int]) -> list[int]:
        import torch

        if self._device_weights is None:
            self._device_weights = torch.from_numpy(self._weights.astype(np.int64)).to(self._pool.device)
        rows = self._pool.view(self._rows, -1)[torch.tensor(block_ids, device=self._pool.device)]
        bits = rows.view(getattr(torch, f"int{8 * rows.element_size()}")).to(torch.int64)
        bits &= (1 << 8 * rows.element_size()) - 1
        sums = (bits * self._device_weights).sum(dim=1)  # wraps mod 2**64: its low 32 bits are the sum's
        return [int(v) & MASK for v in sums.cpu().tolist()]
