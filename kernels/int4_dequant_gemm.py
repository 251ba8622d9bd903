"""Fused dequantize-GEMM for packed integer weights in the GPTQ and AutoAWQ layouts:
``out [M, N] = x [M, K] @ W.T`` with ``W [N, K]`` dequantized tile by tile, never materialised.

GPTQ (4- or 8-bit, ``P = 32 // bits`` values per int32 word, any grouping through ``g_idx``)::

    qweight int32 [K/P, N]   packed along K, low bits first: q[k, n] = word[k // P, n] >> (k % P)*bits
    qzeros  int32 [G, N/P]   packed along N
    scales        [G, N]
    g_idx   int32 [K]
    W[n, k] = scales[g, n] * (q[k, n] - (z[g, n] + zero_offset)),   g = g_idx[k]

AutoAWQ GEMM (4-bit, groups of ``group_size`` consecutive inputs)::

    qweight int32 [K, N/8]   packed along N; column n sits in nibble (n%8 // 2) + 4*(n%2) of
                             word n // 8 (AutoAWQ's order 0, 2, 4, 6, 1, 3, 5, 7)
    qzeros  int32 [K/group_size, N/8], same order;  scales [K/group_size, N]
    W[n, k] = scales[k // group_size, n] * (q[k, n] - z[k // group_size, n])

Grid: (M / BLOCK_M, N / BLOCK_N). A program walks K in BLOCK_K steps: it loads the words that
cover its [BLOCK_K, BLOCK_N] tile of W (each word once per value it holds; the cache serves the
repeats), shifts and masks, subtracts the zero points and multiplies by the scales in float32,
and accumulates ``tl.dot`` in float32 — IEEE dots for float32 activations, the activations'
16-bit type (tensor cores) otherwise, the tile cast to it first, as the torch path casts W.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import FLOAT_DTYPES, check_contiguous, check_device, check_dtype, check_shape

LAYOUT_GPTQ = 0
LAYOUT_AWQ = 1
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr,
    M, N, K, group_size, zero_offset,
    stride_xm, stride_qw, stride_qz, stride_s, stride_om,
    LAYOUT: tl.constexpr, BITS: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < M
    col_in = cols < N
    if LAYOUT == 0:
        col_shift = (cols % PACK) * BITS
    else:
        col_shift = ((cols % 8) // 2 + (cols % 2) * 4) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        tile_in = k_in[:, None] & col_in[None, :]
        if LAYOUT == 0:
            words = tl.load(qweight_ptr + (ks // PACK)[:, None].to(tl.int64) * stride_qw + cols[None, :],
                            mask=tile_in, other=0)
            q = (words >> ((ks % PACK) * BITS)[:, None]) & MASK
            groups = tl.load(g_idx_ptr + ks, mask=k_in, other=0)
        else:
            words = tl.load(qweight_ptr + ks[:, None].to(tl.int64) * stride_qw + (cols // 8)[None, :],
                            mask=tile_in, other=0)
            q = (words >> col_shift[None, :]) & MASK
            groups = ks // group_size
        zero_words = tl.load(qzeros_ptr + groups[:, None].to(tl.int64) * stride_qz + (cols // PACK)[None, :],
                             mask=tile_in, other=0)
        zeros = ((zero_words >> col_shift[None, :]) & MASK) + zero_offset
        scales = tl.load(scales_ptr + groups[:, None].to(tl.int64) * stride_s + cols[None, :],
                         mask=tile_in, other=0.0).to(tl.float32)
        w = (q - zeros).to(tl.float32) * scales
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def _launch(x, qweight, qzeros, scales, g_idx, n, group_size, zero_offset, layout, bits):
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _dequant_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx, out,
        m, n, k, group_size, zero_offset,
        x.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0), out.stride(0),
        LAYOUT=layout, BITS=bits, FP32_DOT=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def _check_common(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("qweight", qweight, (torch.int32,))
    check_dtype("qzeros", qzeros, (torch.int32,))
    check_dtype("scales", scales, SCALE_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    for name, t in (("x", x), ("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        check_contiguous(name, t)


def gptq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """``x [M, K]`` @ the GPTQ weight → ``[M, N]`` in x's dtype (layout in the module docstring)."""
    if bits not in (4, 8):
        raise ValueError(f"GPTQ kernel supports 4 and 8 bits, got {bits}")
    per_word = 32 // bits
    _check_common(x, qweight, qzeros, scales)
    m, k = x.shape
    n = qweight.shape[1]
    num_groups = scales.shape[0]
    check_shape("qweight", qweight, (k // per_word, n))
    check_shape("qzeros", qzeros, (num_groups, n // per_word))
    check_shape("scales", scales, (num_groups, n))
    check_shape("g_idx", g_idx, (k,))
    check_dtype("g_idx", g_idx, (torch.int32,))
    if k % per_word or n % per_word:
        raise ValueError(f"K={k} and N={n} must be multiples of {per_word}")
    check_device(x=x, qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    return _launch(x, qweight, qzeros, scales, g_idx, n, 1, zero_offset, LAYOUT_GPTQ, bits)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int) -> torch.Tensor:
    """``x [M, K]`` @ the AutoAWQ GEMM weight → ``[M, N]`` in x's dtype."""
    _check_common(x, qweight, qzeros, scales)
    m, k = x.shape
    n = qweight.shape[1] * 8
    if group_size < 1 or k % group_size:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}")
    check_shape("qweight", qweight, (k, n // 8))
    check_shape("qzeros", qzeros, (k // group_size, n // 8))
    check_shape("scales", scales, (k // group_size, n))
    check_device(x=x, qweight=qweight, qzeros=qzeros, scales=scales)
    # the AWQ layout has no g_idx: any int32 tensor fills the unused pointer
    return _launch(x, qweight, qzeros, scales, qweight, n, group_size, 0, LAYOUT_AWQ, 4)


# ------------------------------------------------------------------------------ torch reference


def _nibbles(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] → [..., W, 32 // bits] values, value j from bits j*bits upwards."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def gptq_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                        g_idx: torch.Tensor, bits: int, zero_offset: int) -> torch.Tensor:
    """The torch reference of ``gptq_gemm``: dequantize W in float32, cast to x's dtype, matmul."""
    q = _nibbles(qweight.t(), bits).reshape(qweight.shape[1], -1)           # [N, K]
    z = _nibbles(qzeros, bits).reshape(qzeros.shape[0], -1) + zero_offset  # [G, N]
    g = g_idx.long()
    w = (q.float() - z[g].t().float()) * scales[g].t().float()
    return (x.float() @ w.to(x.dtype).float().t()).to(x.dtype)


def awq_gemm_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """The torch reference of ``awq_gemm``."""
    column_of_nibble = torch.tensor((0, 2, 4, 6, 1, 3, 5, 7), device=x.device)
    nibble_of_column = torch.argsort(column_of_nibble)

    def natural(words: torch.Tensor) -> torch.Tensor:
        return _nibbles(words, 4)[..., nibble_of_column].reshape(words.shape[0], -1)

    g = torch.arange(x.shape[1], device=x.device) // group_size
    w = (natural(qweight).float() - natural(qzeros)[g].float()) * scales[g].float()   # [K, N]
    return (x.float() @ w.to(x.dtype).float()).to(x.dtype)
