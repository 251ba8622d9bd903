"""Attention of one query token per sequence over a paged KV cache, split over long contexts.

Sequence ``i`` has one query row ``query[i]`` at position ``seq_lens[i] - 1`` and attends to its
positions ``start .. seq_lens[i]-1`` (``start = max(0, seq_len - W)`` with a sliding window W,
else 0), read through its block table as in paged_prefill_attention::

    kv_cache [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]
    position p of sequence i  →  kv_cache[block_tables[i, p // block_size], :, p % block_size]

Flash-decoding: program (i, kv head, split) takes the ``GROUP = H / Hkv`` query heads that share
that KV head (so each K/V tile is read once for all of them) and one of ``num_splits`` equal,
BLOCK_N-aligned slices of the sequence's context::

    context  |----- split 0 -----|----- split 1 -----|-- split 2 --|
    partials  (m, l, acc) per (i, head, split): running max (log2 domain), sum, unnormalised out

A second kernel merges the splits of each (i, head); with one split the first kernel writes the
output itself. Each sequence divides its own context, so the grid depends only on the batch size
and ``num_splits``: a captured CUDA graph replays correctly for any ``seq_lens``. A sequence of
length 0 (a padding row) gets zeros.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import check_device, check_shape
from tandem.kernels._paged import LOG2E, check_paged_args, dot_precision, output_like
from tandem.kernels.paged_prefill_attention import paged_attention_reference

MAX_SPLITS = 64
MIN_TOKENS_PER_SPLIT = 256
PROGRAMS_PER_SM = 8


@triton.jit
def _paged_decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_bt,
    scale_log2, sliding_window, num_heads, head_dim, num_splits,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    WRITE_OUTPUT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - sliding_window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    g_in = g < GROUP
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_in = dims < head_dim
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=g_in[:, None] & dim_in[None, :], other=0.0).to(tl.float32)
    kv_base = cache_ptr + kv_head * stride_ch
    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        k_in = k_pos < hi
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_in, other=0).to(tl.int64)
        token_off = block * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs
        k_t = tl.load(kv_base + token_off[None, :] + dims[:, None],
                      mask=k_in[None, :] & dim_in[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(k_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_base + stride_ckv + token_off[:, None] + dims[None, :],
                    mask=k_in[:, None] & dim_in[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    if WRITE_OUTPUT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_in[:, None] & dim_in[None, :])
    else:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_in)
        tl.store(part_l_ptr + part, l_i, mask=g_in)
        tl.store(part_acc_ptr + part[:, None] * head_dim + dims[None, :], acc,
                 mask=g_in[:, None] & dim_in[None, :])


@triton.jit
def _merge_splits_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    stride_ot, stride_oh, num_heads, head_dim, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_in = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_in = dims < head_dim
    part = (seq * num_heads + head) * num_splits + splits
    m = tl.load(part_m_ptr + part, mask=split_in, other=float("-inf"))
    weight = tl.exp2(m - tl.max(m, axis=0))
    l_total = tl.sum(tl.load(part_l_ptr + part, mask=split_in, other=0.0) * weight, axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + dims[None, :],
                  mask=split_in[:, None] & dim_in[None, :], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(l_total > 0, l_total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dim_in)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """No split when the (sequence, KV head) programs already fill every multiprocessor; else
    enough splits for about PROGRAMS_PER_SM programs per multiprocessor, but no split shorter
    than MIN_TOKENS_PER_SPLIT tokens and at most MAX_SPLITS (the best of a sweep on an H200)."""
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= num_sms:
        return 1
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query [B, H, D]`` (one token per sequence) → ``out [B, H, D]``, see the module docstring.

    ``block_tables [B, max_blocks]`` and ``seq_lens [B]`` int32. ``num_splits`` fixes the split
    count (keep it fixed for CUDA graphs); by default it comes from ``choose_num_splits`` with
    ``max_seq_len`` (default: ``seq_lens.max()``, which synchronises with the device)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = check_paged_args(query, kv_cache, block_tables, seq_lens, num_heads, head_dim)
    check_shape("seq_lens", seq_lens, (num_seqs,))
    out = output_like(query, out)
    check_device(query=query, kv_cache=kv_cache, block_tables=block_tables, seq_lens=seq_lens, out=out)
    if num_seqs == 0:
        return out
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len,
                                       multiprocessor_count(query.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    block_n = 128 if head_dim <= 128 else 32
    parts = num_seqs * num_heads * num_splits if num_splits > 1 else 0
    part_m = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_l = torch.empty(parts, dtype=torch.float32, device=query.device)
    part_acc = torch.empty(parts * head_dim, dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, out,
        part_m, part_l, part_acc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        scale * LOG2E, sliding_window or 0, num_heads, head_dim, num_splits,
        GROUP=group, BLOCK_SIZE=kv_cache.shape[2], HAS_WINDOW=bool(sliding_window),
        WRITE_OUTPUT=num_splits == 1, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PRECISION=dot_precision(kv_cache.dtype),
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out,
            out.stride(0), out.stride(1), num_heads, head_dim, num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The torch reference of ``paged_decode_attention``: each sequence a one-token chunk."""
    query_start_loc = torch.arange(query.shape[0] + 1, device=query.device)
    return paged_attention_reference(query, kv_cache, block_tables, query_start_loc, seq_lens,
                                     scale, sliding_window)
