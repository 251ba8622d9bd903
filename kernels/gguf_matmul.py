"""Linear layers on GGUF's packed ggml blocks for CUDA: ``out [M, N] = x [M, K] @ W.T`` with
``W`` read from ``qweight`` uint8 [N, row_bytes], the file's blocks of each output row
(``tandem.kernels.gguf_types``; the byte layout of every type is drawn in
kernels/cpu/gguf_matmul.cpp, the CPU kernel with the same contract).

Grid: (M / BLOCK_M, N / BLOCK_N). A program walks K 32 values at a time — one block of the
32-value types, one sub-block of the 256-value K-quants, so every scale the step needs is one
per output row — loads the bytes of its [32, BLOCK_N] tile of W, widens them to float32 with
their scales and accumulates ``tl.dot`` in float32: IEEE dots for float32 activations, the
activations' 16-bit type otherwise (the tile cast to it first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import FLOAT_DTYPES, check_device, check_dtype, check_last_dim_contiguous
from tandem.kernels.gguf_types import check_qweight



@triton.jit
def _half(ptr):
    """float32 of the little-endian IEEE half at byte pointer(s) ``ptr``."""
    bits = tl.load(ptr).to(tl.uint16) | (tl.load(ptr + 1).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _tile(row, k0, kk, TYPE: tl.constexpr):
    """W[n, k0 + kk] as float32 [32, BLOCK_N], ``row`` [1, BLOCK_N] the byte pointers of the rows,
    ``kk`` [32, 1] = 0 .. 31, k0 a multiple of 32."""
    if TYPE == 2:  # Q4_0
        b = row + (k0 // 32) * 18
        q = (_byte(b + 2 + kk % 16) >> (4 * (kk // 16))) & 15
        w = _half(b) * (q - 8).to(tl.float32)
    elif TYPE == 3:  # Q4_1
        b = row + (k0 // 32) * 20
        q = (_byte(b + 4 + kk % 16) >> (4 * (kk // 16))) & 15
        w = _half(b) * q.to(tl.float32) + _half(b + 2)
    elif TYPE == 6:  # Q5_0
        b = row + (k0 // 32) * 22
        q = ((_byte(b + 6 + kk % 16) >> (4 * (kk // 16))) & 15) | (((_byte(b + 2 + kk // 8) >> (kk % 8)) & 1) << 4)
        w = _half(b) * (q - 16).to(tl.float32)
    elif TYPE == 7:  # Q5_1
        b = row + (k0 // 32) * 24
        q = ((_byte(b + 8 + kk % 16) >> (4 * (kk // 16))) & 15) | (((_byte(b + 4 + kk // 8) >> (kk % 8)) & 1) << 4)
        w = _half(b) * q.to(tl.float32) + _half(b + 2)
    elif TYPE == 8:  # Q8_0
        b = row + (k0 // 32) * 34
        w = _half(b) * tl.load(b + 2 + kk).to(tl.int8, bitcast=True).to(tl.float32)
    elif TYPE == 12 or TYPE == 13:  # Q4_K, Q5_K: sub-block s of super-block k0 // 256
        b = row + (k0 // 256) * (144 + 32 * (TYPE - 12))
        s = (k0 % 256) // 32
        lo = s < 4
        b_s = _byte(b + 4 + s)
        b_s4 = _byte(b + 8 + s)
        b_low = _byte(b + 4 + s % 4)
        sc = tl.where(lo, b_s & 63, (b_s4 & 15) | ((b_low >> 6) << 4))
        mn = tl.where(lo, b_s4 & 63, (b_s4 >> 4) | ((b_s >> 6) << 4))
        if TYPE == 12:
            q = (_byte(b + 16 + 32 * (s // 2) + kk) >> (4 * (s % 2))) & 15
        else:
            q = ((_byte(b + 48 + 32 * (s // 2) + kk) >> (4 * (s % 2))) & 15) | (((_byte(b + 16 + kk) >> s) & 1) << 4)
        w = _half(b) * sc.to(tl.float32) * q.to(tl.float32) - _half(b + 2) * mn.to(tl.float32)
    else:  # Q6_K: quarter t of half h of super-block k0 // 256
        b = row + (k0 // 256) * 210
        h = (k0 % 256) // 128
        t = (k0 % 128) // 32
        low = (_byte(b + 64 * h + 32 * (t % 2) + kk) >> (4 * (t // 2))) & 15
        high = (_byte(b + 128 + 32 * h + kk) >> (2 * t)) & 3
        sc = tl.load(b + 192 + 8 * h + 2 * t + kk // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = _half(b + 208) * sc * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _gguf_matmul_kernel(
    x_ptr, q_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
    TYPE: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < M
    col_in = cols < N
    # out-of-range columns read row 0's bytes; their sums are never stored
    w_rows = q_ptr + (tl.where(col_in, cols, 0).to(tl.int64) * row_bytes)[None, :]
    kk = tl.arange(0, 32)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 32):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + tl.arange(0, 32))[None, :],
                    mask=row_in[:, None], other=0.0)
        w = _tile(w_rows, k0, kk, TYPE)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def gguf_linear_triton(x: torch.Tensor, qweight: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """``x [M, in_features] @ W.T`` → a new ``[M, N]`` tensor in x's dtype, ``W`` [N, in_features]
    read from its GGUF blocks ``qweight`` uint8 [N, row_bytes] of ``ggml_type`` (a
    ``GGMLQuantizationType`` value in ``gguf_types.BLOCKS``). ValueError for another type, rows
    that do not fit in_features, or tensors on different devices."""
    block = check_qweight(qweight, ggml_type, in_features)
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [M, in_features={in_features}], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    check_device(x=x, qweight=qweight)
    m, n = x.shape[0], qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gguf_matmul_kernel[grid](
        x, qweight, out, m, n, in_features, block.row_bytes(in_features), x.stride(0), out.stride(0),
        TYPE=int(ggml_type), FP32_DOT=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return out
