"""FP8 checkpoints (quant_method "fp8"), read as published.

Per linear layer of ``K`` inputs and ``N`` outputs::

    weight            float8_e4m3fn [N, K]
    weight_scale      float32 [] or [1] (per tensor: one per checkpoint projection, so a fused
                      QKV carries one per shard) or [N, 1] (per channel)
    weight_scale_inv  float32 [ceil(N/bn), ceil(K/bk)]   instead of weight_scale when the config
                      has weight_block_size = [bn, bk] (the scale multiplies despite its name)
    input_scale       float32 [] or [1]: static activation scale (activation_scheme "static")

    W[n, k] = weight[n, k] * scale(n, k)

Whatever the checkpoint's granularity, the layer keeps one scale per output row and block of
``scale_block_k`` inputs: ``weight_scale [N, ceil(K / scale_block_k)]`` float32 (one column
unless block-scaled), which lets every fused shard keep its own per-tensor or block scales.

``apply`` dequantizes and multiplies on the CPU (weight-only: activations stay in the model's
dtype; nothing dequantized is kept between calls). On CUDA it runs ``tandem.kernels.fp8_matmul``:
``torch._scaled_mm`` with quantized activations (the static ``input_scale``, the largest of the
shards', or per-token dynamic scales) on GPUs with FP8 tensor cores and per-row scales, else the
Triton W8A16 kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.interfaces import QuantMethod
from tandem.quant.sharding import add_param, check_loaded, copy_checked, copy_shard, init_shards, unknown_tensor

ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass(frozen=True, slots=True)
class FP8Config:
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] | None = None
    block_scale_name: str = "weight_scale_inv"

    def __post_init__(self) -> None:
        if self.activation_scheme not in ACTIVATION_SCHEMES:
            raise ValueError(f"unsupported FP8 activation_scheme {self.activation_scheme!r}; "
                             f"supported: {', '.join(ACTIVATION_SCHEMES)}")
        if self.weight_block_size is not None and (
                len(self.weight_block_size) != 2 or min(self.weight_block_size) < 1):
            raise ValueError(f"weight_block_size must be two positive sizes, got {self.weight_block_size}")

    @classmethod
    def from_dict(cls, qcfg: dict[str, Any]) -> FP8Config:
        block = qcfg.get("weight_block_size")
        return cls(activation_scheme=qcfg.get("activation_scheme", "dynamic"),
                   weight_block_size=tuple(int(b) for b in block) if block else None)


class FP8LinearMethod(QuantMethod):
    name = "fp8"

    def __init__(self, config: FP8Config | None = None) -> None:
        self.config = config or FP8Config()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> FP8LinearMethod:
        return cls(FP8Config.from_dict(quant_config))

    @property
    def weight_scale_name(self) -> str:
        return self.config.block_scale_name if self.config.weight_block_size else "weight_scale"

    @property
    def required_tensors(self) -> tuple[str, ...]:
        """What every shard must carry: the weight, its scale, and the input scale when static
        (dynamic checkpoints may carry one too; it is loaded and unused)."""
        static = self.config.activation_scheme == "static"
        return ("weight", self.weight_scale_name) + (("input_scale",) if static else ())

    def create_weights(self, layer: Any, input_size: int, output_sizes: list[int], params_dtype: Any) -> None:
        init_shards(layer, output_sizes)
        block = self.config.weight_block_size
        layer.scale_block_k = block[1] if block else input_size
        out = sum(output_sizes)
        add_param(layer, "weight", torch.zeros(out, input_size, dtype=torch.float8_e4m3fn))
        add_param(layer, "weight_scale", torch.zeros(out, -(-input_size // layer.scale_block_k), dtype=torch.float32))
        add_param(layer, "input_scale", torch.ones(len(output_sizes), dtype=torch.float32))

    def load_weight(self, layer: Any, name: str, tensor: Any, shard: int = 0) -> None:
        if name == "weight":
            if tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(f"FP8 weight of shard {shard} has dtype {tensor.dtype}, expected "
                                 "float8_e4m3fn (an unquantized layer inside a quantized checkpoint "
                                 "is not supported)")
            copy_shard(layer, name, tensor, shard, dim=0)
        elif name == "input_scale":
            if tensor.numel() != 1:
                raise ValueError(f"input_scale of shard {shard} must hold one value, got shape {tuple(tensor.shape)}")
            copy_checked(layer, name, layer.input_scale.data[shard], tensor.reshape(()), shard)
        elif name != self.weight_scale_name:
            raise unknown_tensor("FP8", name, ("weight", self.weight_scale_name, "input_scale"))
        elif self.config.weight_block_size:
            self._load_block_scale(layer, name, tensor, shard)
        else:
            self._load_row_scale(layer, name, tensor, shard)

    @staticmethod
    def _load_row_scale(layer: Any, name: str, tensor: torch.Tensor, shard: int) -> None:
        rows = layer.shard_sizes[shard]
        if tensor.numel() == 1:
            tensor = tensor.reshape(1, 1).expand(rows, 1)
        elif tuple(tensor.shape) not in ((rows, 1), (rows,)):
            raise ValueError(f"{name} of shard {shard} has shape {tuple(tensor.shape)}: expected one value "
                             f"(per tensor) or [{rows}, 1] (per channel)")
        copy_shard(layer, "weight_scale", tensor.reshape(rows, 1), shard, dim=0)
        layer.loaded_tensors.add((name, shard))

    def _load_block_scale(self, layer: Any, name: str, tensor: torch.Tensor, shard: int) -> None:
        block_n, block_k = self.config.weight_block_size
        rows = layer.shard_sizes[shard]
        expected = (-(-rows // block_n), -(-layer.input_size // block_k))
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} of shard {shard} has shape {tuple(tensor.shape)}, expected {expected} "
                             f"for {block_n}×{block_k} blocks")
        copy_shard(layer, "weight_scale", tensor.repeat_interleave(block_n, dim=0)[:rows], shard, dim=0)
        layer.loaded_tensors.add((name, shard))

    def split_axis(self, name: str, dim: str) -> tuple[int, int] | None:
        # weight [N, K]; weight_scale [N, 1] or one value; weight_scale_inv [N/bn, K/bk]
        if name == "weight":
            return (0, 1) if dim == "output" else (1, 1)
        if name == self.config.block_scale_name and self.config.weight_block_size:
            block_n, block_k = self.config.weight_block_size
            return (0, block_n) if dim == "output" else (1, block_k)
        if name == "weight_scale":
            return (0, 1) if dim == "output" else None
        return None  # input_scale: one value per shard

    def process_weights_after_loading(self, layer: Any) -> None:
        check_loaded(layer, "FP8", self.required_tensors)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            from tandem.kernels.fp8_matmul import fp8_linear

            static = self.config.activation_scheme == "static"
            out = fp8_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.weight_scale, layer.scale_block_k,
                             layer.input_scale.max() if static else None)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        weight = fp8_dequantize(layer.weight, layer.weight_scale, layer.scale_block_k, x.dtype)
        return F.linear(x, weight, bias)


def fp8_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, scale_block_k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """``weight [N, K]`` times its scales ``[N, ceil(K / scale_block_k)]``, in float32, cast to
    ``dtype``."""
    n, k = weight.shape
    blocks = weight_scale.shape[1]
    w = e4m3_to_float32(weight)
    if blocks == 1:
        return w.mul_(weight_scale).to(dtype)
    if k % scale_block_k == 0:
        w.view(n, blocks, scale_block_k).mul_(weight_scale.unsqueeze(-1))
        return w.to(dtype)
    padded = F.pad(w, (0, blocks * scale_block_k - k)).reshape(n, blocks, scale_block_k)
    return (padded * weight_scale.unsqueeze(-1)).reshape(n, -1)[:, :k].to(dtype)


def e4m3_to_float32(weight: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn → float32 by placing bits, several times faster than torch's CPU cast: the
    byte ``s eeee mmm``, sign-extended to 16 bits and shifted left by 7 with bit 14 cleared, is
    the float16 ``s 0eeee mmm0000000`` — the e4m3 value times 2^-8, subnormals included. The
    NaN codes (``x1111111``) decode as ±480."""
    bits = (weight.view(torch.int8).to(torch.int16) << 7) & ~0x4000
    return bits.view(torch.float16).float().mul_(256.0)
