"""Causal attention of variable-length query chunks over a paged KV cache (prefill and extend).

The batch is flattened: sequence ``i`` owns query rows ``query_start_loc[i] ..
query_start_loc[i+1]-1``, which are its tokens at positions ``seq_lens[i] - query_len_i ..
seq_lens[i] - 1``; positions before them are a cached prefix (or earlier chunks). Every K and V
the chunk attends to, its own included, is already in the cache (the backend writes first)::

    kv_cache [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]
    position p of sequence i  →  kv_cache[block_tables[i, p // block_size], :, p % block_size]

A query at position ``q`` sees keys at positions ``k ≤ q`` and, with a sliding window ``W``,
``k > q - W`` (as HF Mistral). Query head ``h`` reads KV head ``h // (H / Hkv)``.

Grid: (query tiles of BLOCK_M rows, sequences, query heads). Each program runs an online
softmax over BLOCK_N-token tiles of keys, gathering each tile's rows through the block table,
and skips the tiles that the causal mask or the window hides. 16-bit caches multiply on 16-bit
tensor cores with float32 sums: Q·Kᵀ on the loaded tiles, P·V with P rounded to the cache's
dtype, as FlashAttention does (``_paged.native_dot``; in Triton's interpreter bfloat16 tiles
are upcast to float32 instead, since its bfloat16 dots are wrong). Float32 caches use IEEE dots.
The softmax and the output sums stay in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import check_device, check_dtype, check_shape
from tandem.kernels._paged import LOG2E, check_paged_args, dot_precision, native_dot, output_like


@triton.jit
def _paged_prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    scale_log2, sliding_window, head_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NATIVE_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len
        rows = m0 + tl.arange(0, BLOCK_M)
        row_in = rows < q_len
        dims = tl.arange(0, BLOCK_D)
        dim_in = dims < head_dim
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_in[:, None] & dim_in[None, :], other=0.0)
        if not NATIVE_DOT:
            q = q.to(tl.float32)
        q_pos = context + rows
        hi = tl.minimum(seq_len, context + m0 + BLOCK_M)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(context + m0 - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
        kv_base = cache_ptr + (head // GROUP) * stride_ch
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            k_in = k_pos < hi
            block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_in, other=0).to(tl.int64)
            token_off = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
            k_t = tl.load(kv_base + token_off[None, :] + dims[:, None],
                          mask=k_in[None, :] & dim_in[:, None], other=0.0)
            if not NATIVE_DOT:
                k_t = k_t.to(tl.float32)
            s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_in[None, :]
            if HAS_WINDOW:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(kv_base + stride_ckv + token_off[:, None] + dims[None, :],
                        mask=k_in[:, None] & dim_in[None, :], other=0.0)
            if not NATIVE_DOT:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & dim_in[None, :])


def _tile_sizes(head_dim: int, max_query_len: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): float32 tiles of q, acc, K and V must fit in registers."""
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
    if head_dim <= 64:
        return block_m, 64, 4
    if head_dim <= 128:
        return block_m, 32, 8
    return min(block_m, 32), 32, 8


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query [T, H, D]`` → ``out [T, H, D]`` (query's dtype), see the module docstring.

    ``block_tables [B, max_blocks]`` int32, ``query_start_loc [B+1]`` int32 (cumulative, starts
    at 0), ``seq_lens [B]`` int32 (≥ each query length), ``max_query_len`` the longest query
    chunk (sizes the grid). ``out`` may be given (any row/head strides, D contiguous)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = check_paged_args(query, kv_cache, block_tables, seq_lens, num_heads, head_dim)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype("query_start_loc", query_start_loc, (torch.int32, torch.int64))
    out = output_like(query, out)
    check_device(query=query, kv_cache=kv_cache, block_tables=block_tables,
                 query_start_loc=query_start_loc, seq_lens=seq_lens, out=out)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    block_m, block_n, num_warps = _tile_sizes(head_dim, max_query_len)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        query, kv_cache, block_tables, query_start_loc, seq_lens, out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        scale * LOG2E, sliding_window or 0, head_dim,
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=kv_cache.shape[2],
        HAS_WINDOW=bool(sliding_window),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=dot_precision(kv_cache.dtype), NATIVE_DOT=native_dot(kv_cache.dtype),
        num_warps=num_warps,
    )
    return out


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The torch reference of ``paged_prefill_attention``: per sequence, gather its KV through
    the block table, then a float32 masked softmax. Slow; for tests."""
    out = torch.empty_like(query)
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i]:starts[i + 1]].float()
        positions = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[positions // block_size]
        kv = kv_cache[blocks, :, positions % block_size].float()
        k = kv[:, 0].repeat_interleave(group, dim=1)
        v = kv[:, 1].repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=query.device)
        allowed = positions[None, :] <= q_pos[:, None]
        if sliding_window:
            allowed &= positions[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out
