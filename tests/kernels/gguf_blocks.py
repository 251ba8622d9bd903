"""GGUF test weights for the packed-block kernel tests: blocks made by ``gguf``'s own quantizer
where it has one, else random bytes with their half-float scale fields set to small finite
values; and the oracle, ``gguf``'s numpy dequantizer."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

QUANTIZABLE = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
               GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0)
K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
HALF_FIELDS = {  # byte offsets of each K-quant's half floats: d, dmin / d
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def packed(ggml_type: GGMLQuantizationType, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: the blocks of a random [n, k] weight."""
    rng = np.random.default_rng(seed)
    if ggml_type in QUANTIZABLE:
        return torch.from_numpy(quants.quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type))
    elems, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for offset in HALF_FIELDS[ggml_type]:
        halves = (rng.standard_normal((n, k // elems)) * 0.01).astype(np.float16)
        raw[..., offset:offset + 2] = halves.view(np.uint8).reshape(n, k // elems, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def dequantized(qweight: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """float64 [n, k]: gguf's numpy dequantization of the blocks."""
    return torch.from_numpy(quants.dequantize(qweight.numpy(), ggml_type).astype(np.float64))
