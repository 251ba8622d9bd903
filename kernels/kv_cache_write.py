"""Writes one step's new K and V into their slots of a layer's paged KV cache.

A layer's cache is the view ``pool[:, layer]`` of the block-major pool::

    kv_cache [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]   (any strides,
                                                                           head_dim contiguous)
    slot s  →  block s // block_size, offset s % block_size

Token ``t`` of ``key``/``value [T, num_kv_heads, head_dim]`` goes to slot ``slot_mapping[t]``;
slot -1 writes nothing (padding rows of captured CUDA graphs). One program per token.
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


@triton.jit
def _kv_cache_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        dst = cache_ptr + block * stride_cb + offset * stride_cs + heads * stride_ch + dims
        elem = cache_ptr.dtype.element_ty
        # Loads go through float32 (exact for every input dtype): the interpreter mishandles bf16.
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask).to(tl.float32)
        tl.store(dst, k.to(elem), mask=mask)
        v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask).to(tl.float32)
        tl.store(dst + stride_ckv, v.to(elem), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter ``key``/``value [T, num_kv_heads, head_dim]`` into ``kv_cache`` (see the module
    docstring) at ``slot_mapping [T]`` (int32/int64, -1 = skip). Same dtype for all three."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _, _, block_size, _, _ = kv_cache.shape
    check_shape("kv_cache", kv_cache, (kv_cache.shape[0], 2, block_size, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_dtype("kv_cache", kv_cache, FLOAT_DTYPES)
    check_dtype("key", key, (kv_cache.dtype,))
    check_dtype("value", value, (kv_cache.dtype,))
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    for name, t in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    check_device(key=key, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    _kv_cache_write_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache_reference(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """The torch reference of ``write_kv_cache`` (same contract)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = key[keep]
    kv_cache[blocks, 1, offsets] = value[keep]
