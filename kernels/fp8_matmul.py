"""FP8 (e4m3fn) weights times higher-precision activations: ``out [M, N] = x [M, K] @ W.T``.

The weight comes with float32 scales per output row and per block of ``scale_block_k`` inputs::

    weight       float8_e4m3fn [N, K]
    weight_scale float32       [N, ceil(K / scale_block_k)]
    W[n, k] = weight[n, k] * weight_scale[n, k // scale_block_k]

(per-tensor and per-channel scales are the case ``scale_block_k = K``: one column; 128×128 block
scales are expanded to one row per output by the caller). Two paths:

- ``fp8_dequant_matmul``: the Triton kernel. Grid (M / BLOCK_M, N / BLOCK_N); each program walks
  K, decodes its [BLOCK_K, BLOCK_N] tile of e4m3 bytes with integer operations (so it runs on any
  GPU and in the interpreter), scales it in float32 and accumulates ``tl.dot`` in float32.
  Activations stay unquantized (W8A16).
- ``fp8_scaled_mm``: ``torch._scaled_mm`` on FP8 tensor cores (compute capability ≥ 8.9, one
  scale column): activations are quantized to e4m3 too — with the checkpoint's static
  ``input_scale``, else dynamically per token (row amax / 448) — and both scales are applied to
  the float32 product (W8A8).

``fp8_linear`` picks ``fp8_scaled_mm`` where it applies and the kernel elsewhere.

e4m3fn decoding: the byte ``s eeee mmm`` placed as ``s 0eeee mmm0000000`` is a float16 whose
value is the e4m3 value times 2^-8 (both exponent biases differ by 8, subnormals included), so
the kernel bit-casts and multiplies by 256. The NaN byte (``x1111111``) decodes as ±480.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import FLOAT_DTYPES, check_contiguous, check_device, check_dtype, check_shape

FP8_MAX = 448.0
SCALED_MM_CAPABILITY = (8, 9)


@triton.jit
def _fp8_dequant_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr,
    M, N, K, scale_block_k,
    stride_xm, stride_wn, stride_sn, stride_om,
    FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows < M
    col_in = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        tile_in = k_in[:, None] & col_in[None, :]
        byte = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                       mask=tile_in, other=0).to(tl.int32)
        half_bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
        w = half_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        scale = tl.load(scale_ptr + cols[None, :].to(tl.int64) * stride_sn + (ks // scale_block_k)[:, None],
                        mask=tile_in, other=0.0)
        w = w * scale
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


def _check_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scale_block_k: int) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (torch.float8_e4m3fn,))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
    if scale_block_k < 1:
        raise ValueError(f"scale_block_k must be positive, got {scale_block_k}")
    check_shape("weight_scale", weight_scale, (n, -(-k // scale_block_k)))
    for name, t in (("x", x), ("weight", weight), ("weight_scale", weight_scale)):
        check_contiguous(name, t)


def fp8_dequant_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       scale_block_k: int) -> torch.Tensor:
    """``x [M, K]`` @ the scaled FP8 weight → ``[M, N]`` in x's dtype, by the Triton kernel."""
    _check_weight(x, weight, weight_scale, scale_block_k)
    check_device(x=x, weight=weight, weight_scale=weight_scale)
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_dequant_gemm_kernel[grid](
        x, weight.view(torch.uint8), weight_scale, out,
        m, n, k, scale_block_k,
        x.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        FP32_DOT=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out


def scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    """Whether ``fp8_scaled_mm`` serves this call: a CUDA device with FP8 tensor cores, one scale
    per output row, and K and N multiples of 16 (``torch._scaled_mm``'s alignment)."""
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < SCALED_MM_CAPABILITY:
        return False
    n, k = weight.shape
    return weight_scale.shape[1] == 1 and k % 16 == 0 and n % 16 == 0


def fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None) -> torch.Tensor:
    """W8A8 through ``torch._scaled_mm``: ``x`` quantized to e4m3 with ``input_scale`` (a float32
    scalar) or, when None, per row; ``weight_scale [N, 1]``. Returns ``[M, N]`` in x's dtype."""
    _check_weight(x, weight, weight_scale, weight.shape[1])
    if input_scale is None:
        x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    else:
        x_scale = input_scale.float().reshape(1, 1)
    x_fp8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    product = torch._scaled_mm(x_fp8, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (product * x_scale * weight_scale.reshape(1, -1)).to(x.dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, scale_block_k: int,
               input_scale: torch.Tensor | None) -> torch.Tensor:
    """The GPU path of the FP8 linear layers: ``fp8_scaled_mm`` where it applies, else the kernel."""
    if scaled_mm_applies(x, weight, weight_scale):
        return fp8_scaled_mm(x, weight, weight_scale, input_scale)
    return fp8_dequant_matmul(x, weight, weight_scale, scale_block_k)


# ------------------------------------------------------------------------------ torch references


def fp8_dequant_matmul_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                 scale_block_k: int) -> torch.Tensor:
    """The torch reference of ``fp8_dequant_matmul``: W in float32, cast to x's dtype, matmul."""
    k = weight.shape[1]
    scale = weight_scale.repeat_interleave(scale_block_k, dim=1)[:, :k]
    w = (weight.float() * scale).to(x.dtype)
    return (x.float() @ w.float().t()).to(x.dtype)


def fp8_scaled_mm_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            input_scale: torch.Tensor | None) -> torch.Tensor:
    """The torch reference of ``fp8_scaled_mm``: both operands rounded to e4m3 the same way, the
    product of their dequantized values in float32."""
    xf = x.float()
    if input_scale is None:
        x_scale = torch.stack([row.abs().max() / FP8_MAX for row in xf]).clamp(min=1e-12)[:, None]
    else:
        x_scale = torch.full((x.shape[0], 1), float(input_scale))
    x_deq = torch.clamp(xf / x_scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * x_scale
    w_deq = weight.float() * weight_scale
    return (x_deq @ w_deq.t()).to(x.dtype)
