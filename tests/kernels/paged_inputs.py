"""Random paged KV caches and block tables for the attention kernel tests.

A cache is one layer's view of a two-layer pool, so the kernels see the real strides::

    pool  [num_blocks, 2 layers, 2 (K, V), block_size, num_kv_heads, head_dim]
    cache = pool[:, 1]
"""
from __future__ import annotations

import torch


def random_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen)
    return pool.to(device=device, dtype=dtype)[:, 1]


def scattered_block_tables(seq_lens: list[int], block_size: int, num_blocks: int,
                           gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Disjoint tables drawn in random order from blocks 1.., padded with 0 (the null block)."""
    needed = [-(-n // block_size) for n in seq_lens]
    assert sum(needed) < num_blocks, "test pool too small"
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width = max(max(needed), 1)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
    return tables.to(device)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """Output tolerances against a float32 reference rounded to ``dtype``. bf16 allows two ulps:
    the interpreter truncates float32→bf16 casts where a GPU rounds to nearest."""
    return {torch.float32: dict(atol=2e-5, rtol=1e-5),
            torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}[dtype]


def poison_unused(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int]) -> None:
    """NaN everywhere except the positions the sequences own, so that a read outside them shows."""
    block_size = cache.shape[2]
    keep = torch.zeros(cache.shape[:3], dtype=torch.bool, device=cache.device)
    for i, seq_len in enumerate(seq_lens):
        positions = torch.arange(seq_len, device=cache.device)
        keep[block_tables[i].long()[positions // block_size], :, positions % block_size] = True
    cache[~keep] = float("nan")
