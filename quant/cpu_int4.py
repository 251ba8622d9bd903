"""4-bit weights on the CPU through torch's packed-int4 matmul, for bfloat16 activations.

``torch._weight_int4pack_mm_for_cpu`` multiplies bfloat16 ``x [M, K]`` by a weight stored as
packed nibbles plus one (scale, zero) pair per group of ``group_size`` inputs and output::

    W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n],   g = k // group_size

GPTQ and AWQ both store ``W[n, k] = (q - z[g, n]) * s[g, n]``, which is that form with
``scale = s`` and ``zero = (8 - z) * s``. GPTQ's activation order (desc_act: ``g_idx`` in any
order) becomes contiguous groups by permuting the inputs: the packed weight's input ``k`` is
``x[:, perm[k]]``.

The kernel's time grows with the rows of ``x`` (it reads the weight once per row), so it beats
dequantizing the whole weight and running a dense bfloat16 matmul only for few rows (where they
cross: docs/benchmarks.md). ``MAX_ROWS`` is where the quant methods switch to dequantizing.
Supported: group sizes 32, 64, 128 and 256 dividing K, N a multiple of 16, every group exactly
``group_size`` inputs; ``pack`` returns None otherwise.
The packed copy is kept beside the checkpoint's tensors (which the dequantizing path reads), so
a layer's 4-bit weights take twice their memory: still half of bfloat16's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ROWS = 64
GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 2


@dataclass(slots=True)
class PackedInt4:
    """A layer's weight in the kernel's layout: ``packed [N, K/2]`` uint8, ``scales_and_zeros
    [K/group_size, N, 2]`` bfloat16, and ``perm [K]`` (None when the inputs keep their order)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    perm: torch.Tensor | None


def available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(torch, "_convert_weight_to_int4pack_for_cpu")


def pack(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
         group_size: int) -> PackedInt4 | None:
    """``q [K, N]`` integers in [0, 16), ``zeros``/``scales [G, N]`` (zero points as the format
    subtracts them), ``g_idx [K]`` the group of each input (None: ``k // group_size``).
    None when the kernel is missing or the shapes do not suit it."""
    k, n = q.shape
    if not available() or group_size not in GROUP_SIZES or k % group_size or n % 16:
        return None
    if zeros.shape != (k // group_size, n) or scales.shape != zeros.shape:
        return None
    perm = None
    if g_idx is not None:
        natural = torch.arange(k, device=g_idx.device) // group_size
        if not torch.equal(g_idx.long(), natural):
            perm = torch.argsort(g_idx.long(), stable=True)
            if not torch.equal(g_idx.long()[perm], natural):
                return None  # some group is not exactly group_size inputs
            q = q[perm]
    weight = q.t().to(torch.int32).contiguous()
    s = scales.float()
    scales_and_zeros = torch.stack((s, (8 - zeros.float()) * s), dim=2).to(torch.bfloat16).contiguous()
    return PackedInt4(torch._convert_weight_to_int4pack_for_cpu(weight, _INNER_K_TILES),
                      scales_and_zeros, group_size, perm)


def usable(packed: PackedInt4 | None, x: torch.Tensor) -> bool:
    """Whether ``matmul(x, packed)`` is the faster path for ``x``."""
    return (packed is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.numel() // x.shape[-1] <= MAX_ROWS)


def matmul(x: torch.Tensor, packed: PackedInt4, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` bfloat16 → ``x @ W.T (+ bias)`` ``[..., N]`` bfloat16."""
    rows = x.reshape(-1, x.shape[-1])
    if packed.perm is not None:
        rows = rows.index_select(1, packed.perm)
    out = torch._weight_int4pack_mm_for_cpu(rows.contiguous(), packed.packed, packed.group_size,
                                            packed.scales_and_zeros)
    out = out.reshape(*x.shape[:-1], out.shape[-1])
    return out if bias is None else out + bias
