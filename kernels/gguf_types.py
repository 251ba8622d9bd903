"""The ggml block types tandem's GGUF kernels multiply by (``cpu_ops.gguf_linear``,
``gguf_matmul.gguf_linear_triton``): block sizes for shape checks, and the one argument check
both launchers share.

A quantized weight ``[N, K]`` is kept as the GGUF file's bytes, one row per output feature::

    qweight uint8 [N, row_bytes],   row_bytes = (K / block.elems) * block.bytes

row ``n`` being the ``K / block.elems`` consecutive blocks of ``W[n, :]`` (layouts of each
block in kernels/cpu/gguf_matmul.cpp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class GgufBlock:
    """One ggml block type: ``elems`` weights in ``bytes`` bytes."""

    name: str
    elems: int
    bytes: int

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of ``in_features`` weights (a multiple of ``elems``)."""
        return in_features // self.elems * self.bytes


BLOCKS: dict[int, GgufBlock] = {
    int(GGMLQuantizationType.Q4_0): GgufBlock("Q4_0", 32, 18),
    int(GGMLQuantizationType.Q4_1): GgufBlock("Q4_1", 32, 20),
    int(GGMLQuantizationType.Q5_0): GgufBlock("Q5_0", 32, 22),
    int(GGMLQuantizationType.Q5_1): GgufBlock("Q5_1", 32, 24),
    int(GGMLQuantizationType.Q8_0): GgufBlock("Q8_0", 32, 34),
    int(GGMLQuantizationType.Q4_K): GgufBlock("Q4_K", 256, 144),
    int(GGMLQuantizationType.Q5_K): GgufBlock("Q5_K", 256, 176),
    int(GGMLQuantizationType.Q6_K): GgufBlock("Q6_K", 256, 210),
}
"""The ggml types with a kernel, by ``GGMLQuantizationType`` value."""


def block_of(ggml_type: int) -> GgufBlock:
    """The block of ``ggml_type``, or a ValueError naming it and the supported types."""
    block = BLOCKS.get(int(ggml_type))
    if block is None:
        try:
            name = GGMLQuantizationType(int(ggml_type)).name
        except ValueError:
            name = "unknown"
        raise ValueError(f"no GGUF kernel for ggml type {int(ggml_type)} ({name}); supported: "
                         f"{', '.join(b.name for b in BLOCKS.values())}")
    return block


def check_qweight(qweight: torch.Tensor, ggml_type: int, in_features: int) -> GgufBlock:
    """``qweight`` is uint8 ``[N, row_bytes]``, contiguous, for ``in_features`` weights per row
    of ``ggml_type``; returns the block, or raises ValueError saying what is wrong."""
    block = block_of(ggml_type)
    if in_features <= 0 or in_features % block.elems:
        raise ValueError(f"in_features={in_features} must be a positive multiple of {block.name}'s "
                         f"block of {block.elems}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2:
        raise ValueError(f"qweight must be uint8 [N, row_bytes], got {qweight.dtype} {tuple(qweight.shape)}")
    if qweight.shape[1] != block.row_bytes(in_features):
        raise ValueError(f"qweight rows hold {qweight.shape[1]} bytes, expected {block.row_bytes(in_features)} "
                         f"for in_features={in_features} of {block.name}")
    if not qweight.is_contiguous():
        raise ValueError(f"qweight must be contiguous (strides {qweight.stride()})")
    return block
