"""Rotary position embedding, "neox" style as in HF Llama: the head dimension is split in halves
that rotate together (``rotate_half``), with optional linear or Llama 3 frequency scaling.

cos and sin are computed once per forward pass from the step's positions, in float32 exactly as HF
does (``position * inv_freq``, then cos and sin), and every layer then applies the same pair. On
the CPU, steps whose positions are all below ``TABLE_MAX_POSITIONS`` look them up instead in a
table of the same values in the step's dtype, computed as a step would compute them (chunks of
``TABLE_CHUNK`` positions) and grown as positions are met: two lookups instead of eight operators
a step. No table covers every position: at 128k positions and head_dim 256 one would take 256 MiB.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from tandem.interfaces import AttentionMetadata
from tandem.models.config import RopeScaling

# metadata.extra key: the prompt length of each sequence of the step (a list of ints)
PROMPT_LENS_KEY = "num_prompt_tokens"
TABLE_MAX_POSITIONS = 16384
TABLE_CHUNK = 256


def compute_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``base ** (-2i / head_dim)`` for i < head_dim/2, float32, scaled."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "longrope":
        return _longrope_inv_freq(exponents, base, scaling.short_factor, "short_factor")
    return _llama3_scale(inv_freq, scaling)


def _longrope_inv_freq(exponents: torch.Tensor, base: float, factors: tuple[float, ...], name: str) -> torch.Tensor:
    if len(factors) != len(exponents):
        raise ValueError(f"longrope {name} has {len(factors)} entries, the rotary dimension needs {len(exponents)}")
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)


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
    """The inverse frequencies ``[head_dim / 2]`` (float32, not saved in the state dict).

    Longrope keeps two sets and picks one per token as HF's ``generate`` does for a sequence with
    a prompt of ``P`` tokens: the long factors when ``P`` exceeds the original context (prompt and
    output alike) or the token's position reaches it, else the short ones. That is, long iff
    ``max(position, P - 1) >= original``; ``forward`` gets ``P`` per sequence through
    ``metadata.extra[PROMPT_LENS_KEY]`` (without it, each token's own position decides, which is
    the same for every token past its prompt).
    """

    def __init__(self, head_dim: int, base: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", compute_inv_freq(head_dim, base, scaling).float(), persistent=False)
        self.attention_factor = scaling.attention_factor if scaling is not None else 1.0
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.long_from = None
        if scaling is not None and scaling.rope_type == "longrope":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
            long = _longrope_inv_freq(exponents, base, scaling.long_factor, "long_factor")
            self.register_buffer("long_inv_freq", long, persistent=False)
            self.long_from = scaling.original_max_position_embeddings

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                metadata: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` → ``(cos, sin)``, each ``[T, head_dim]`` in ``dtype``."""
        if (self.long_from is None and metadata is not None and positions.device.type == "cpu"
                and metadata.max_seq_len <= TABLE_MAX_POSITIONS):
            cos, sin = self._table(dtype, metadata.max_seq_len)
            return cos.index_select(0, positions), sin.index_select(0, positions)
        return self._compute(positions, dtype, metadata)

    def _table(self, dtype: torch.dtype, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions 0 .. at least ``positions - 1`` in ``dtype`` (module doc)."""
        cos, sin = self._tables.get(dtype, (None, None))
        if cos is None or cos.shape[0] < positions:
            size = min(TABLE_MAX_POSITIONS, max(TABLE_CHUNK, 1 << (positions - 1).bit_length()))
            chunks = [self._compute(torch.arange(start, min(start + TABLE_CHUNK, size)), dtype)
                      for start in range(0, size, TABLE_CHUNK)]
            cos, sin = torch.cat([c for c, _ in chunks]), torch.cat([s for _, s in chunks])
            self._tables[dtype] = (cos, sin)
        return cos, sin

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype,
                 metadata: AttentionMetadata | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :]
        if self.long_from is not None:
            select = positions
            prompt_lens = metadata.extra.get(PROMPT_LENS_KEY) if metadata is not None else None
            if prompt_lens is not None:
                last_prompt = torch.tensor([p - 1 for p in prompt_lens], device=positions.device)
                counts = torch.tensor(metadata.query_lens_cpu, device=positions.device)
                select = torch.maximum(positions, last_prompt.repeat_interleave(counts))
            inv_freq = torch.where((select >= self.long_from)[:, None], self.long_inv_freq[None, :], inv_freq)
        freqs = positions.to(torch.float32)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
