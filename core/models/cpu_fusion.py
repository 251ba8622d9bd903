"""Fused element-wise steps of the decoder layers on the CPU (``kernels/cpu/elementwise.cpp``).

Per layer and step torch runs the residual add and RMSNorm as six operations (add, cast, pow,
mean, rsqrt, mul...) and rotary and SiLU-and-mul as four or five, each a pass over the rows with
its own temporary, a visible share of a small model's decode step. Once
``enable_cpu_fusion(model)`` has asked the modules to (``RMSNorm.use_kernel``,
``use_cpu_kernels`` of the others: each module decides whether it can), they call one C++ pass
each instead:

- ``RMSNorm`` with or without the residual add, in place on the layer's fresh output, and
  ``GemmaRMSNorm`` (its scale ``1 + weight`` in float32);
- ``GatedMLP`` with SiLU or tanh-approximated GELU: ``act(gate) * up`` straight from the fused
  gate/up projection;
- ``Attention`` with full-width rotary (no partial rotary dims): q and k normed (Qwen3's and
  Gemma's q/k norms) and rotated in place.

The kernels round to the model's dtype wherever torch does, so a bfloat16 model gives torch's
values, not just close ones; float32 differs from torch by the order of its sums. CPU tensors
only; ``engine.cpu_kernels = "torch"`` leaves every module on torch (the reference).
"""
from __future__ import annotations

import torch
from torch import nn

from tandem.kernels import cpu_ops
from tandem.models.layers import Attention, GatedMLP, GemmaRMSNorm, RMSNorm


def enable_cpu_fusion(model: nn.Module) -> int:
    """Ask the modules of ``model`` to run their step as a fused kernel; returns how many took
    it (0 when tandem's CPU kernels cannot be built here)."""
    if not cpu_ops.load():
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, GemmaRMSNorm):
            count += module.use_kernel(gemma_rms_norm)
        elif isinstance(module, RMSNorm):
            count += module.use_kernel(rms_norm)
        elif isinstance(module, (GatedMLP, Attention)):
            count += module.use_cpu_kernels()
    return count


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward``'s contract: (normed, new residual). With a residual, ``x`` (the
    layer's own output) is overwritten with the normed sum and ``residual`` with the sum."""
    x2 = x.view(-1, x.shape[-1])
    if residual is None:
        out = torch.empty_like(x2)
        cpu_ops.rms_norm(out, x2, weight, eps)
        return out.view(x.shape), x
    cpu_ops.add_rms_norm(x2, residual.view(-1, x.shape[-1]), weight, eps)
    return x, residual


def gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``GemmaRMSNorm.forward``'s contract: (normed, new residual), the inputs untouched."""
    if residual is not None:
        x = x + residual
    x2 = x.view(-1, x.shape[-1])
    out = torch.empty_like(x2)
    cpu_ops.gemma_rms_norm(out, x2, weight, eps)
    return out.view(x.shape), x
