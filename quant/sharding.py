"""What the quantized linear methods share: parameters laid out for fused output shards, each
shard's checkpoint tensors copied into its slice, and a check that every tensor arrived.

A fused layer (QKV, gate/up) of ``output_sizes = [o0, o1, ...]`` keeps one parameter per tensor
kind, the shards side by side along the dimension that indexes outputs (columns of GPTQ's and
AWQ's ``[in, out]`` tensors, rows of FP8's ``[out, in]`` weight), scaled by how many outputs one
element covers (8 for a packed int4 word)::

    qweight [in/8, o0 + o1 + o2]:  | shard 0: o0 cols | shard 1: o1 cols | shard 2: o2 cols |
    qzeros  [G, (o0 + o1 + o2)/8]: | o0/8            | o1/8             | o2/8             |
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def init_shards(layer: Any, output_sizes: list[int]) -> None:
    """Record the shard offsets on ``layer`` and start its record of loaded tensors."""
    layer.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
    layer.shard_sizes = list(output_sizes)
    layer.loaded_tensors = set()


def add_param(layer: Any, name: str, tensor: torch.Tensor) -> None:
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


def copy_shard(layer: Any, name: str, tensor: torch.Tensor, shard: int, dim: int,
               per_element: int = 1) -> None:
    """Copy checkpoint tensor ``name`` of output ``shard`` into its slice of ``layer.<name>``
    along ``dim``, where one element of the parameter covers ``per_element`` outputs."""
    param = getattr(layer, name)
    start = layer.shard_offsets[shard] // per_element
    size = layer.shard_sizes[shard] // per_element
    copy_checked(layer, name, param.data.narrow(dim, start, size), tensor, shard)


def copy_checked(layer: Any, name: str, target: torch.Tensor, tensor: torch.Tensor, shard: int) -> None:
    """Copy ``tensor`` into ``target`` after checking its shape and its dtype family (an int
    tensor never lands in a float parameter or the other way round), and record it loaded."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{name} of shard {shard} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(target.shape)}")
    if tensor.dtype.is_floating_point != target.dtype.is_floating_point:
        raise ValueError(f"{name} of shard {shard} has dtype {tensor.dtype}, expected {target.dtype}")
    target.copy_(tensor)
    layer.loaded_tensors.add((name, shard))


def check_loaded(layer: Any, method: str, required: tuple[str, ...]) -> None:
    """Raise ValueError naming every (tensor, shard) of ``required`` the checkpoint lacked."""
    missing = [f"{name} of shard {shard}" for shard in range(len(layer.shard_sizes))
               for name in required if (name, shard) not in layer.loaded_tensors]
    if missing:
        raise ValueError(f"a {method} linear layer ({layer.input_size} → {layer.shard_sizes}) "
                         f"lacks {', '.join(missing)} in the checkpoint")


def unknown_tensor(method: str, name: str, known: tuple[str, ...]) -> ValueError:
    hint = (" (an unquantized layer inside a quantized checkpoint is not supported)"
            if name == "weight" else "")
    return ValueError(f"{method} linear layers have no tensor {name!r}; expected one of "
                      f"{', '.join(known)}{hint}")
