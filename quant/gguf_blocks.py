"""ggml's quantized blocks dequantized with torch ops, for the types a GGUF file's weights use.

A row of ``K`` weights is ``K / B`` blocks of ``S`` bytes each (``BLOCKS[ggml_type] = (B, S)``);
each block holds its own scales and ``B`` packed values::

    row:   | block 0: S bytes | block 1 | ... | block K/B - 1 |
    Q4_0:  | d f16 | qs[16]: value j in the low nibble of qs[j], value j + 16 in its high nibble |
    Q4_K:  | d f16 | dmin f16 | scales[12]: 8 × (6-bit scale, 6-bit min) | qs[128] |

The layouts (and the order of the float32 operations, so that the values are bit-identical)
are ggml's, as ``gguf.quants`` dequantizes them:

    type   B    S    value
    Q4_0   32   18   d·(q − 8)
    Q4_1   32   20   d·q + m
    Q5_0   32   22   d·(q − 16), the fifth bit of q in a 32-bit mask
    Q5_1   32   24   d·q + m, likewise
    Q8_0   32   34   d·q, q int8
    Q2_K   256  84   (d·sc)·q − dmin·mn, 16 sub-blocks of 16, 2-bit q, 4-bit sc/mn
    Q3_K   256  110  (d·(sc − 32))·(q − 4·!hbit), 16 sub-blocks, 6-bit sc
    Q4_K   256  144  (d·sc)·q − dmin·mn, 8 sub-blocks of 32, 6-bit sc/mn
    Q5_K   256  176  as Q4_K with a fifth bit
    Q6_K   256  210  (d·sc)·(q − 32), 16 sub-blocks of 16, int8 sc

    rows = dequantize_rows(qweight, ggml_type, in_features, torch.float32)   # uint8 [N, K/B·S] → [N, K]
"""
from __future__ import annotations

from collections.abc import Callable

import torch

BLOCKS: dict[int, tuple[int, int]] = {
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
}
"""ggml type number → (values per block, bytes per block), for every block type supported."""

TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def type_name(ggml_type: int) -> str:
    return TYPE_NAMES.get(ggml_type, f"ggml type {ggml_type}")


def row_bytes(ggml_type: int, in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` values; ValueError when the type is not a
    supported block type or the row is not whole blocks."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"{type_name(ggml_type)} blocks are not supported; supported: "
                         f"{', '.join(TYPE_NAMES.values())}")
    values, size = BLOCKS[ggml_type]
    if in_features % values:
        raise ValueError(f"a row of {in_features} values is not whole {type_name(ggml_type)} blocks of {values}")
    return in_features // values * size


def dequantize_rows(qweight: torch.Tensor, ggml_type: int, in_features: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 rows ``[..., row_bytes]`` → ``[..., in_features]`` in ``dtype`` (computed in float32)."""
    size = row_bytes(ggml_type, in_features)
    assert qweight.dtype == torch.uint8 and qweight.shape[-1] == size, (qweight.dtype, qweight.shape, size)
    lead = qweight.shape[:-1]
    blocks = qweight.reshape(-1, BLOCKS[ggml_type][1])
    values = _DEQUANTIZE[ggml_type](blocks)
    return values.reshape(*lead, in_features).to(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte ``start`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _split_bits(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """``x [n, g, w]`` → ``[n, g, len(shifts), w]``: field ``i`` is ``(x >> shifts[i]) & mask``."""
    shift = torch.tensor(shifts, dtype=torch.int32, device=x.device).view(-1, 1)
    return (x.to(torch.int32).unsqueeze(-2) >> shift) & mask


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """Each group of ``w`` bytes → its ``w`` low nibbles, then its ``w`` high nibbles ``[n, 2·qs]``."""
    n = qs.shape[0]
    return _split_bits(qs.reshape(n, groups, -1), (0, 4), 0x0F).reshape(n, -1)


def _high_bits32(mask_bytes: torch.Tensor) -> torch.Tensor:
    """The 32 bits of a little-endian 32-bit mask ``[n, 4]`` → ``[n, 32]`` (bit j for value j)."""
    mask = mask_bytes.contiguous().view(torch.int32)
    return (mask >> torch.arange(32, dtype=torch.int32, device=mask.device)) & 1


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:], 1) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:], 1).float() + _f16(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:], 1) | (_high_bits32(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:], 1) | (_high_bits32(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16].to(torch.int32)
    dl = (_f16(b, 80) * (scales & 0xF).float()).view(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = _split_bits(b[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _split_bits(b[:, 96:104].reshape(n, 1, 8), (0, 4), 0x0F).reshape(n, 16)
    high = _split_bits(b[:, 104:108].reshape(n, 1, 4), (0, 2, 4, 6), 3).reshape(n, 16)
    dl = (_f16(b, 108) * ((low | (high << 4)) - 32).float()).view(n, 16, 1)
    q = _split_bits(b[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    hbit = _split_bits(b[:, :32].reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 16, 16)
    return (dl * (q - ((hbit ^ 1) << 2)).float()).reshape(n, 256)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes → 8 six-bit scales and 8 six-bit mins (int32 ``[n, 8]``)::

        bytes 0-3: low 6 bits = scales 0-3, top 2 bits = the high bits of scales 4-7
        bytes 4-7: likewise for mins 0-3 / 4-7
        bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = of mins 4-7
    """
    s = scales.to(torch.int32).view(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).view(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).view(n, 8, 1)
    q = _nibbles(b[:, 16:], 4).view(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).view(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).view(n, 8, 1)
    high = _split_bits(b[:, 16:48].reshape(n, 1, 32), tuple(range(8)), 1).reshape(n, 8, 32)
    q = (_nibbles(b[:, 48:], 4).view(n, 8, 32) | (high << 4)).float()
    return (d * q - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _nibbles(b[:, :128], 2).view(n, 8, 32)
    high = _split_bits(b[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 8, 32)
    q = ((low | (high << 4)) - 32).view(n, 16, 16).float()
    return (d * q).reshape(n, 256)


_DEQUANTIZE: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 8: _q8_0,
    10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k, 14: _q6_k,
}
