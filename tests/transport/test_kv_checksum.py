"""Block checksums (``tandem.transport.kv_checksum``) against their written definition, computed
here with Python integers, and the same checksum from the shares of pools split another way."""
from __future__ import annotations

import pytest
import torch

from tandem.interfaces import KVPoolDescriptor, KVShard
from tandem.transport.kv_checksum import BlockChecksums

LAYERS, BS, HEADS, DIM, BLOCKS = 2, 4, 2, 3, 5
M64 = (1 << 64) - 1
M32 = (1 << 32) - 1


def splitmix(i: int) -> int:
    z = (i + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def oracle(pool: torch.Tensor, block: int) -> int:
    """The docstring's sum over the model's whole block, element by element."""
    bits = pool.view(torch.int32)  # as unsigned: & M32
    total = 0
    for layer in range(LAYERS):
        for kv in range(2):
            for t in range(BS):
                for h in range(HEADS):
                    for d in range(DIM):
                        index = (((layer * 2 + kv) * BS + t) * HEADS + h) * DIM + d
                        total += (int(bits[block, layer, kv, t, h, d]) & M32) * (splitmix(index) & M32)
    return total & M32


def shard_pool(pool: torch.Tensor, shard: KVShard) -> torch.Tensor:
    return pool[:, shard.layer_start:shard.layer_stop, :, :, shard.head_start:shard.head_stop].contiguous()


def shares(pool: torch.Tensor, shards: list[KVShard], blocks: list[int]) -> list[int]:
    parts = []
    for rank, shard in enumerate(shards):
        local = shard_pool(pool, shard)
        parts.append(BlockChecksums(local, KVPoolDescriptor.for_pool(local, "c", shards, rank)).of(blocks))
    return [sum(column) & M32 for column in zip(*parts)]


@pytest.fixture(scope="module")
def pool() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(BLOCKS, LAYERS, 2, BS, HEADS, DIM)


def test_a_whole_pool_gives_the_defined_checksum(pool):
    checksums = BlockChecksums(pool, KVPoolDescriptor.for_pool(pool, "c")).of([3, 0])
    assert checksums == [oracle(pool, 3), oracle(pool, 0)]


@pytest.mark.parametrize("split", ["tp2", "pp2", "tp4_replicated"])
def test_the_shares_of_a_split_pool_add_up_to_it(pool, split):
    shards = {
        "tp2": [KVShard(0, LAYERS, h, h + 1, BS, DIM, 4) for h in range(HEADS)],
        "pp2": [KVShard(layer, layer + 1, 0, HEADS, BS, DIM, 4) for layer in range(LAYERS)],
        # 4 ranks over 2 KV heads: each head held twice, counted once
        "tp4_replicated": [KVShard(0, LAYERS, r // 2, r // 2 + 1, BS, DIM, 4) for r in range(4)],
    }[split]
    assert shares(pool, shards, [1, 4]) == [oracle(pool, 1), oracle(pool, 4)]


def test_half_a_block_overwritten_changes_its_checksum(pool):
    damaged = pool.clone()
    damaged.view(BLOCKS, -1).view(torch.uint8)[2, damaged[0].numel() * 2:] = 0x5A
    whole = BlockChecksums(pool, KVPoolDescriptor.for_pool(pool, "c"))
    assert BlockChecksums(damaged, KVPoolDescriptor.for_pool(damaged, "c")).of([1, 2]) != whole.of([1, 2])
    assert BlockChecksums(damaged, KVPoolDescriptor.for_pool(damaged, "c")).of([1]) == whole.of([1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_path_gives_the_same_checksums(pool, dtype):
    """torch integer ops (what a CUDA pool uses), run here on the CPU pool, against numpy's."""
    typed = pool.to(dtype)
    checksums = BlockChecksums(typed, KVPoolDescriptor.for_pool(typed, "c"))
    assert checksums._of_device([0, 3, 4]) == checksums._of_host([0, 3, 4])
