"""The unquantized linear method: one dense weight ``[sum(output_sizes), input_size]`` in the
model's dtype, fused shards stacked along the output dimension::

    weight rows: [ shard 0 (e.g. q) | shard 1 (k) | shard 2 (v) ]
                   0 .. o0-1          o0 .. o0+o1-1   ...

``apply`` is ``F.linear``, or on the CPU the packed weight's kernel once
``tandem.models.cpu_linear`` has packed the layer (``layer.packed``; the dense weight is gone).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.interfaces import QuantMethod


class UnquantizedLinearMethod(QuantMethod):
    name = "unquantized"

    def create_weights(
        self, layer: Any, input_size: int, output_sizes: list[int], params_dtype: Any
    ) -> None:
        weight = torch.empty(sum(output_sizes), input_size, dtype=params_dtype)
        layer.weight = nn.Parameter(weight, requires_grad=False)
        layer.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        layer.shard_sizes = list(output_sizes)

    def load_weight(self, layer: Any, name: str, tensor: Any, shard: int = 0) -> None:
        if name != "weight":
            raise ValueError(f"unquantized linear layers have only a weight, got {name!r}")
        start, size = layer.shard_offsets[shard], layer.shard_sizes[shard]
        target = layer.weight.data[start : start + size]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"weight shard {shard} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if layer.packed is not None:
            return layer.packed(x, bias)
        return F.linear(x, layer.weight, bias)

    def split_axis(self, name: str, dim: str) -> tuple[int, int] | None:
        return (0, 1) if dim == "output" else (1, 1)  # weight [out, in]
