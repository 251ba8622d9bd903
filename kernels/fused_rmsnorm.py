"""RMSNorm with the residual add fused in front, rounded as HF Llama's ``LlamaRMSNorm``.

For each row of ``x [N, hidden]`` (``residual`` optional, same shape and dtype)::

    s   = x + residual                        (rounded to x.dtype; s = x without a residual)
    out = weight * (s / sqrt(mean(s²) + eps))  normalised in float32, rounded to x.dtype, then
                                               multiplied by weight and rounded again

``s`` is written back into ``residual`` (in place) and is the next layer's residual. One program
per row; a row must fit one block (hidden ≤ 65536).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import (
    FLOAT_DTYPES,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
)

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    elem = out_ptr.dtype.element_ty
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        rounded = (s + r).to(elem)
        tl.store(residual_ptr + row * stride_r + cols, rounded, mask=mask)
        s = rounded.to(tl.float32)
    variance = tl.sum(s * s, axis=0) / hidden
    normed = (s * tl.math.rsqrt(variance + eps)).to(elem).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(elem), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, hidden]``, ``weight [hidden]`` (x's dtype) → ``(out, new_residual)``.

    Without ``residual`` the new residual is ``x`` itself; with it, ``residual`` is overwritten
    with ``x + residual`` and returned (the contract of tandem.models.layers.RMSNorm). ``out``
    may be given (e.g. a CUDA graph's static buffer); rows may be strided, columns contiguous."""
    num_rows, hidden = x.shape
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, (x.dtype,))
    check_shape("weight", weight, (hidden,))
    check_last_dim_contiguous("x", x)
    check_last_dim_contiguous("weight", weight)
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel's {MAX_HIDDEN}")
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_shape("residual", residual, (num_rows, hidden))
        check_dtype("residual", residual, (x.dtype,))
        check_last_dim_contiguous("residual", residual)
        tensors["residual"] = residual
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    check_shape("out", out, (num_rows, hidden))
    check_dtype("out", out, (x.dtype,))
    check_last_dim_contiguous("out", out)
    check_device(out=out, **tensors)
    if num_rows:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x
        _rmsnorm_kernel[(num_rows,)](
            x, res, weight, out,
            x.stride(0), res.stride(0), out.stride(0),
            hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out, (residual if residual is not None else x)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``rms_norm`` (same contract, ``residual`` updated in place)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, x
