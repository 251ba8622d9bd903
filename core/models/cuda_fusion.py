"""Fused element-wise steps of the decoder layers on CUDA (tandem's Triton kernels).

Per layer and step torch runs the residual add and RMSNorm as five or six kernels (add, cast,
the norm, cast, multiply), each a round trip of the rows through memory. Once
``enable_cuda_fusion(model)`` has offered every ``RMSNorm`` the kernel (``use_kernel``), the
norm runs as one pass of ``tandem.kernels.fused_rmsnorm``: the residual add in front (the sum
written back into ``residual``), the norm in float32, rounded to the model's dtype where torch rounds
(``weight * normed.to(dtype)``, HF Llama's), so it gives torch's values up to the order of the
float32 sum. Gemma's variant (weight + 1, scaled in float32) keeps torch's path.

Rotary stays on torch on CUDA: HF rounds ``q * cos + rotate_half(q) * sin`` to the model's dtype
after each operation, which a one-rounding kernel does not reproduce in bfloat16, and under CUDA
graphs its launches cost nothing.

Any tensor device works as far as the kernel goes (the tests run it on the CPU under
``TRITON_INTERPRET=1``); the worker enables it for CUDA models only.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("tandem")


def enable_cuda_fusion(model: nn.Module) -> int:
    """Offer every plain ``RMSNorm`` of ``model`` the Triton kernel (Gemma's variant, which
    scales differently, keeps torch); returns how many took it (0 when triton cannot be
    imported: the model keeps torch's norm)."""
    from tandem.models.layers import GemmaRMSNorm, RMSNorm

    try:
        from tandem.kernels import fused_rmsnorm  # noqa: F401 - imports triton
    except ImportError as exc:
        logger.warning("triton could not be imported (%s); RMSNorm stays on torch's kernels", exc)
        return 0
    return sum(m.use_kernel(rms_norm) for m in model.modules()
               if isinstance(m, RMSNorm) and not isinstance(m, GemmaRMSNorm))


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward``'s contract: (normed, new residual). With a residual, ``residual`` is
    overwritten with ``x + residual`` and returned; without, ``x`` is the new residual."""
    from tandem.kernels.fused_rmsnorm import rms_norm as kernel

    rows = x.view(-1, x.shape[-1])
    out, _ = kernel(rows, weight, eps, None if residual is None else residual.view(-1, x.shape[-1]))
    return out.view(x.shape), x if residual is None else residual
