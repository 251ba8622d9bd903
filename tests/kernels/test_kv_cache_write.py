"""write_kv_cache scatters each token's K and V into its slot and touches nothing else."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference

NUM_BLOCKS = 12


def _case(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, gen):
    """A NaN-poisoned two-layer pool (layer 1 is written), K/V as views of a fused QKV output,
    distinct random slots with every third one -1."""
    pool = torch.full((NUM_BLOCKS, 2, 2, block_size, num_kv_heads, head_dim), float("nan"),
                      dtype=dtype, device=device)
    width = (2 + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(device=device, dtype=dtype)
    kv = qkv[:, 2 * head_dim:].view(num_tokens, 2, num_kv_heads, head_dim)
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return pool, kv[:, 0], kv[:, 1], slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (4, 64), (2, 128)])
def test_matches_reference_and_skips_minus_one(dtype, num_kv_heads, head_dim, device, gen):
    pool, key, value, slots = _case(10, num_kv_heads, head_dim, 16, dtype, device, gen)
    expected = pool.clone()
    write_kv_cache_reference(key, value, expected[:, 1], slots)
    write_kv_cache(key, value, pool[:, 1], slots)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0, equal_nan=True)
    written = int(pool.isfinite().all(dim=-1).all(dim=-1).sum())
    assert written == 2 * int((slots >= 0).sum())


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_slots_decode_to_block_and_offset(block_size, device, gen):
    pool, key, value, slots = _case(7, 2, 64, block_size, torch.float32, device, gen)
    write_kv_cache(key, value, pool[:, 1], slots.to(torch.int32))
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            assert torch.equal(pool[block, 1, 0, offset], key[t])
            assert torch.equal(pool[block, 1, 1, offset], value[t])
    assert pool[:, 0].isnan().all(), "layer 0 must stay untouched"


def test_all_slots_skipped_writes_nothing(device, gen):
    pool, key, value, slots = _case(4, 2, 64, 16, torch.float16, device, gen)
    write_kv_cache(key, value, pool[:, 1], torch.full_like(slots, -1))
    assert pool.isnan().all()


def test_rejects_mismatched_dtypes(device, gen):
    pool, key, value, slots = _case(4, 2, 64, 16, torch.float16, device, gen)
    with pytest.raises(ValueError, match="key has dtype"):
        write_kv_cache(key.float(), value, pool[:, 1], slots)
    with pytest.raises(ValueError, match="slot_mapping has dtype"):
        write_kv_cache(key, value, pool[:, 1], slots.float())
