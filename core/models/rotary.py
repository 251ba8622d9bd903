"""Rotary position embedding, "neox" style as in HF Llama: the head dimension is split in halves
that rotate together (``rotate_half``), with optional linear or Llama 3 frequency scaling.

cos and sin are computed once per forward pass from the step's positions, in float32 exactly as HF
does (``position * inv_freq``, then cos and sin), and every layer then applies the same pair. No
per-position table is kept: at 128k positions and head_dim 256 one would take 256 MiB.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tandem.models.config import RopeScaling


def compute_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``base ** (-2i / head_dim)`` for i < head_dim/2, float32, scaled."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "longrope":
        if len(scaling.short_factor) != len(exponents):
            raise ValueError(f"longrope short_factor has {len(scaling.short_factor)} entries, the rotary "
                             f"dimension needs {len(exponents)}")
        return 1.0 / (torch.tensor(scaling.short_factor, dtype=torch.float32) * base**exponents)
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Wavelengths longer than original/low_freq_factor are divided by factor; shorter than
    # original/high_freq_factor are kept; in between, a linear blend by the smoothing weight.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated by ``cos``/``sin [T, D]`` (neox style, as HF Llama)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, D]``, ``k [T, Hkv, D]``, ``cos``/``sin [T, D]`` → rotated q and k."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """The inverse frequencies ``[head_dim / 2]`` (float32, not saved in the state dict)."""

    def __init__(self, head_dim: int, base: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, base, scaling).float(), persistent=False)
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` → ``(cos, sin)``, each ``[T, head_dim]`` in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
