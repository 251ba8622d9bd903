"""Rotary position embedding applied in place to queries and keys, "neox" style as HF Llama.

Each head vector splits into halves ``x1 = x[:D/2]``, ``x2 = x[D/2:]``; with ``c = cos[pos]``
and ``s = sin[pos]`` (rows of the ``[max_position, D]`` tables, float32)::

    out = x * c + rotate_half(x) * s,   rotate_half(x) = (-x2, x1)
    out[:D/2] = x1 * c[:D/2] - x2 * s[:D/2]
    out[D/2:] = x2 * c[D/2:] + x1 * s[D/2:]

computed in float32 and rounded once to the tensor's dtype. One program per token rotates all
of its query and key heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels._checks import (
    FLOAT_DTYPES,
    check_contiguous,
    check_device,
    check_dtype,
    check_last_dim_contiguous,
    check_shape,
)


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    lo = x_ptr + heads * stride_h + dims
    x1 = tl.load(lo, mask=mask).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask).to(tl.float32)
    elem = x_ptr.dtype.element_ty
    tl.store(lo, (x1 * c1 - x2 * s1).to(elem), mask=mask)
    tl.store(lo + HALF, (x2 * c2 + x1 * s2).to(elem), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    num_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = dims < HALF
    row = pos * stride_cache + dims
    c1 = tl.load(cos_ptr + row, mask=dmask)
    c2 = tl.load(cos_ptr + row + HALF, mask=dmask)
    s1 = tl.load(sin_ptr + row, mask=dmask)
    s2 = tl.load(sin_ptr + row + HALF, mask=dmask)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_kv_heads, c1, c2, s1, s2,
                  HALF, BLOCK_HK, BLOCK_HALF)


def apply_rotary_(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """Rotate ``query [T, H, D]`` and ``key [T, Hkv, D]`` in place (views of a fused QKV
    projection are fine: any token/head strides, D contiguous) by ``positions [T]``.
    ``cos_cache``/``sin_cache [max_position, D]`` float32, contiguous; positions must be
    below max_position (not checked on the device)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("positions", positions, (num_tokens,))
    check_shape("cos_cache", cos_cache, (cos_cache.shape[0], head_dim))
    check_shape("sin_cache", sin_cache, tuple(cos_cache.shape))
    check_dtype("query", query, FLOAT_DTYPES)
    check_dtype("key", key, (query.dtype,))
    check_dtype("positions", positions, (torch.int32, torch.int64))
    check_dtype("cos_cache", cos_cache, (torch.float32,))
    check_dtype("sin_cache", sin_cache, (torch.float32,))
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("key", key)
    check_contiguous("cos_cache", cos_cache)
    check_contiguous("sin_cache", sin_cache)
    check_device(query=query, key=key, positions=positions, cos_cache=cos_cache, sin_cache=sin_cache)
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, positions, cos_cache, sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0),
        num_heads, num_kv_heads,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HK=triton.next_power_of_2(num_kv_heads),
    )


def rotary_reference(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``apply_rotary_``: returns the rotated copies, inputs untouched."""
    cos = cos_cache[positions.long()][:, None, :]
    sin = sin_cache[positions.long()][:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        return (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    return rotate(query), rotate(key)
