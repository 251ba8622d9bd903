"""Sub-byte integers packed into int32 words, as GPTQ and AutoAWQ checkpoints store them.

A word holds ``32 // bits`` values, value ``j`` in bits ``[j*bits, (j+1)*bits)``, low bits first::

    word = v0 | v1 << 4 | v2 << 8 | ... | v7 << 28                        (bits = 4)

GPTQ packs ``qweight [in/8, out]`` along the input dimension and ``qzeros [groups, out/8]`` along
the output dimension, both in natural order. AutoAWQ packs ``qweight [in, out/8]`` and ``qzeros``
along the output dimension in an interleaved order: nibble ``j`` of word ``c`` holds column
``8*c + AWQ_PACK_ORDER[j]``::

    nibble:  0  1  2  3  4  5  6  7
    column:  0  2  4  6  1  3  5  7      (+ 8*c)

Words are signed int32 (a nibble ≥ 8 in the top position makes the word negative); unpacking
masks after an arithmetic shift, so the sign never leaks into a value.
"""
from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# column j of a group of 8 sits in nibble AWQ_NIBBLE_OF_COLUMN[j]
AWQ_NIBBLE_OF_COLUMN = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))
SUPPORTED_BITS = (4, 8)


def values_per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit packing is not supported; supported: {SUPPORTED_BITS}")
    return 32 // bits


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit integers (any integer dtype, each in ``[0, 2**bits)``) into int32
    words along ``dim``, whose size must be a multiple of ``32 // bits``."""
    per_word = values_per_word(bits)
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"cannot pack {moved.shape[-1]} values into words of {per_word}")
    if moved.numel() and (moved.min() < 0 or moved.max() >= 1 << bits):
        raise ValueError(f"values out of the {bits}-bit range [0, {(1 << bits) - 1}]")
    grouped = moved.reshape(*moved.shape[:-1], -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64, device=values.device) * bits
    words = (grouped << shifts).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of ``pack_int32``: int32 words → uint8 values, ``32 // bits`` times longer
    along ``dim``. Fast when ``dim`` is not the last dimension (whole rows are written at once);
    along the last dimension of a large tensor prefer ``unpack_int32_planes``."""
    per_word = values_per_word(bits)
    dim = dim % packed.dim()
    shape = list(packed.shape)
    out = torch.empty(shape[: dim + 1] + [per_word] + shape[dim + 1:], dtype=torch.uint8, device=packed.device)
    for j in range(per_word):
        out.select(dim + 1, j).copy_((packed >> (bits * j)) & ((1 << bits) - 1))
    shape[dim] *= per_word
    return out.view(shape)


def unpack_int32_planes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Words packed along the last dimension, ``[..., W]`` → uint8 ``[..., 32 // bits, W]`` where
    ``[..., j, c]`` is value ``j`` of word ``c`` (value j of every word is one contiguous plane)."""
    per_word = values_per_word(bits)
    out = torch.empty(*packed.shape[:-1], per_word, packed.shape[-1], dtype=torch.uint8, device=packed.device)
    for j in range(per_word):
        out.select(-2, j).copy_((packed >> (bits * j)) & ((1 << bits) - 1))
    return out


def awq_interleave(columns: torch.Tensor) -> torch.Tensor:
    """Reorder the last dimension (columns, a multiple of 8) into AutoAWQ's nibble order, so
    that ``pack_int32(awq_interleave(v), 4, -1)`` is AutoAWQ's packing of ``v``."""
    if columns.shape[-1] % 8:
        raise ValueError(f"AWQ packing needs a multiple of 8 columns, got {columns.shape[-1]}")
    index = torch.tensor(AWQ_PACK_ORDER, device=columns.device)
    grouped = columns.reshape(*columns.shape[:-1], -1, 8)
    return grouped.index_select(-1, index).reshape(columns.shape)
