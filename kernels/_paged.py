"""What the paged attention launchers share: argument checks, the output, the dot precision."""
from __future__ import annotations

import os

import torch

from tandem.kernels._checks import FLOAT_DTYPES, check_dtype, check_last_dim_contiguous, check_shape

LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """tf32 holds fp16 and bf16 values exactly; float32 caches need IEEE dots."""
    return "ieee" if dtype == torch.float32 else "tf32"


def native_dot(dtype: torch.dtype) -> bool:
    """Whether a kernel multiplies 16-bit tiles as they are (16-bit tensor cores, float32 sums)
    rather than upcast to float32 first: float16 always; bfloat16 except in Triton's
    interpreter, whose bfloat16 dots come out wrong (it upcasts there, the tests' CPU runs)."""
    if dtype == torch.float16:
        return True
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") != "1"


def check_paged_args(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, num_heads: int, head_dim: int) -> int:
    """Checks shared by the prefill and decode launchers; returns num_kv_heads."""
    if kv_cache.dim() != 5:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    num_blocks, _, block_size, num_kv_heads, _ = kv_cache.shape
    check_shape("kv_cache", kv_cache, (num_blocks, 2, block_size, num_kv_heads, head_dim))
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES)
    check_dtype("query", query, (kv_cache.dtype,))
    check_dtype("block_tables", block_tables, (torch.int32, torch.int64))
    check_dtype("seq_lens", seq_lens, (torch.int32, torch.int64))
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables must be [num_seqs={seq_lens.shape[0]}, max_blocks], "
                         f"got shape {tuple(block_tables.shape)}")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous in its last dimension")
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("kv_cache", kv_cache)
    return num_kv_heads


def output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against ``query``, or a new contiguous tensor like it."""
    if out is None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    check_shape("out", out, tuple(query.shape))
    check_dtype("out", out, (query.dtype,))
    check_last_dim_contiguous("out", out)
    return out
