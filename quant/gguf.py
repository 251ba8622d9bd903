"""A llama.cpp GGUF file's weights kept quantized in memory (``model.quantization = "gguf"``).

The loader (``tandem.models.gguf_weights``, ``packed=True``) hands each linear shard its file
tensor as it is stored: a block type as ``ggml_type`` (a 0-d int tensor, the ggml type number)
and ``qweight``, the file's bytes of each output row cut into whole blocks::

    qweight  uint8 [N, K/B, S]   row n = the K values of output n, in K/B blocks of S bytes
                                 (tandem.quant.gguf_blocks draws the block layouts)

and a float tensor (F32, F16, BF16 in the file) as a plain ``weight [N, K]``. The shards of a fused
projection may differ in type (a Q4_K_M file mixes Q4_K and Q6_K): after loading, each run of
adjacent shards of one type becomes one part, kept as ``qweight_<i>`` (uint8 ``[n, K/B·S]``) or
``weight_<i>`` (the model's dtype), and ``apply`` concatenates the parts' outputs::

    qkv_proj of a Q4_K_M file:  part 0 = q, k (Q4_K) | part 1 = v (Q6_K)  →  y = [y0 | y1]

``apply`` multiplies by a part's blocks directly where a kernel takes its type
(``tandem.kernels.gguf_types.BLOCKS``): ``cpu_ops.gguf_linear`` on the CPU (float32 or bfloat16
activations), ``gguf_matmul.gguf_linear_triton`` on CUDA; other types (Q2_K, Q3_K) and
activations are dequantized with torch ops (``tandem.quant.gguf_blocks``) and multiplied,
nothing dequantized kept between calls. The token embedding and the LM head are linear layers
of this method too (``quantizes_embeddings``): ``embed`` dequantizes only the rows looked up.

Tensor parallelism: output rows split anywhere (whole rows); inputs only on block boundaries
(``K / tp`` a multiple of the type's 32 or 256 values per block), else a ValueError naming the
tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tandem.interfaces import QuantMethod, TensorSplit
from tandem.kernels import cpu_ops
from tandem.kernels.gguf_types import BLOCKS as KERNEL_BLOCKS
from tandem.quant.gguf_blocks import BLOCKS, dequantize_rows, type_name
from tandem.quant.sharding import add_param, init_shards, unknown_tensor

TENSORS = ("qweight", "ggml_type", "weight")


@dataclass(frozen=True, slots=True)
class GGUFPart:
    """Adjacent output shards of one storage: outputs ``start .. start + size - 1`` of the layer,
    in parameter ``param`` (``qweight_<i>`` of ``ggml_type``, or ``weight_<i>`` with
    ``ggml_type`` None)."""

    param: str
    ggml_type: int | None
    start: int
    size: int


class GGUFLinearMethod(QuantMethod):
    name = "gguf"
    quantizes_embeddings: ClassVar[bool] = True
    reads_gguf_blocks: ClassVar[bool] = True

    def create_weights(self, layer: Any, input_size: int, output_sizes: list[int], params_dtype: Any) -> None:
        init_shards(layer, output_sizes)
        layer.params_dtype = params_dtype
        layer.gguf_device = torch.empty(0).device
        layer.gguf_shards = [{} for _ in output_sizes]
        """Per shard, what the checkpoint gave (``qweight``, ``ggml_type``, ``weight``) until
        ``process_weights_after_loading`` turns them into parts."""
        layer.gguf_parts = []

    def load_weight(self, layer: Any, name: str, tensor: Any, shard: int = 0) -> None:
        if name not in TENSORS:
            raise unknown_tensor("GGUF", name, TENSORS)
        staged = layer.gguf_shards[shard]
        if name == "ggml_type":
            staged[name] = int(tensor)
        elif name == "weight":
            _check_shape(layer, name, tensor, shard, (layer.output_sizes[shard], layer.input_size))
            staged[name] = tensor.to(layer.gguf_device, layer.params_dtype, copy=True)
        else:
            if tensor.dtype != torch.uint8 or tensor.dim() != 3:
                raise ValueError(f"qweight of shard {shard} must be uint8 [rows, blocks, block bytes], "
                                 f"got {tensor.dtype} {tuple(tensor.shape)}")
            staged[name] = tensor.to(layer.gguf_device, copy=True)
        layer.loaded_tensors.add((name, shard))

    def split_axis(self, name: str, dim: str) -> tuple[int, int] | None:
        # weight [out, in]; qweight [out, blocks, bytes]: along inputs split_tensor cuts whole blocks
        if name == "ggml_type":
            return None
        return (0, 1) if dim == "output" else (1, 1)

    def split_tensor(self, name: str, tensor: Any, split: TensorSplit, logical_size: int) -> Any:
        if name != "qweight" or split.dim == "output":
            return super().split_tensor(name, tensor, split, logical_size)
        blocks = tensor.shape[1]
        if blocks % split.parts:
            raise ValueError(f"qweight of shape {tuple(tensor.shape)}: {logical_size} inputs in {blocks} blocks of "
                             f"{logical_size // blocks} do not split into {split.parts} parts of whole blocks")
        size = blocks // split.parts
        return tensor.narrow(1, split.index * size, size)

    def process_weights_after_loading(self, layer: Any) -> None:
        runs: list[tuple[int | None, list[torch.Tensor], int]] = []  # (type, rows of each shard, first output)
        for shard, staged in enumerate(layer.gguf_shards):
            ggml_type, rows = self._shard_rows(layer, shard, staged)
            if runs and runs[-1][0] == ggml_type:
                runs[-1][1].append(rows)
            else:
                runs.append((ggml_type, [rows], layer.shard_offsets[shard]))
        layer.gguf_parts = []
        for i, (ggml_type, rows, start) in enumerate(runs):
            param = f"{'weight' if ggml_type is None else 'qweight'}_{i}"
            data = rows[0] if len(rows) == 1 else torch.cat(rows)
            add_param(layer, param, data)
            layer.gguf_parts.append(GGUFPart(param, ggml_type, start, data.shape[0]))
        layer.gguf_shards = None

    @staticmethod
    def _shard_rows(layer: Any, shard: int, staged: dict[str, Any]) -> tuple[int | None, torch.Tensor]:
        """(ggml type or None, the shard's rows ``[N, K/B·S]`` or plain ``[N, K]``), checked."""
        where = f"shard {shard} of a GGUF linear layer ({layer.input_size} → {layer.shard_sizes})"
        if "weight" in staged:
            if "qweight" in staged:
                raise ValueError(f"{where} got both a weight and a qweight")
            return None, staged["weight"]
        if "qweight" not in staged or "ggml_type" not in staged:
            missing = [n for n in ("qweight", "ggml_type") if n not in staged]
            raise ValueError(f"{where} lacks {' and '.join(missing)} in the checkpoint")
        ggml_type, qweight = staged["ggml_type"], staged["qweight"]
        if ggml_type not in BLOCKS:
            raise ValueError(f"{where}: {type_name(ggml_type)} blocks are not supported; supported: "
                             f"{', '.join(type_name(t) for t in BLOCKS)}")
        values, size = BLOCKS[ggml_type]
        if layer.input_size % values:
            raise ValueError(f"{where}: {layer.input_size} inputs are not whole {type_name(ggml_type)} blocks")
        _check_shape(layer, "qweight", qweight, shard,
                     (layer.output_sizes[shard], layer.input_size // values, size))
        return ggml_type, qweight.reshape(qweight.shape[0], -1)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [self._part_linear(layer, part, x) for part in layer.gguf_parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def _part_linear(self, layer: Any, part: GGUFPart, x: torch.Tensor) -> torch.Tensor:
        data = getattr(layer, part.param)
        if part.ggml_type is None:
            return F.linear(x, data.to(x.dtype))
        if part.ggml_type in KERNEL_BLOCKS and (x.is_cuda or _cpu_kernel(x)):
            x2 = x.reshape(-1, layer.input_size).contiguous()
            if x.is_cuda:
                from tandem.kernels.gguf_matmul import gguf_linear_triton

                out = gguf_linear_triton(x2, data, part.ggml_type, layer.input_size)
            else:
                out = cpu_ops.gguf_linear(x2, data, part.ggml_type, layer.input_size)
            return out.view(*x.shape[:-1], part.size)
        return F.linear(x, dequantize_rows(data, part.ggml_type, layer.input_size, x.dtype))

    def embed(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the layer's weight (the token embedding), dequantized to its dtype."""
        (part,) = layer.gguf_parts
        data = getattr(layer, part.param)
        if part.ggml_type is None:
            return data[ids]
        if part.ggml_type in KERNEL_BLOCKS and not data.is_cuda and cpu_ops.load():
            rows = cpu_ops.gguf_dequantize_rows(data, part.ggml_type, layer.input_size, ids.reshape(-1).long(),
                                                layer.params_dtype)
            return rows.view(*ids.shape, layer.input_size)
        return dequantize_rows(data[ids], part.ggml_type, layer.input_size, layer.params_dtype)


def _cpu_kernel(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float32, torch.bfloat16) and cpu_ops.load()


def _check_shape(layer: Any, name: str, tensor: torch.Tensor, shard: int, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} of shard {shard} has shape {tuple(tensor.shape)}, expected {expected}")
