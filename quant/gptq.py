"""GPTQ checkpoints (AutoGPTQ / GPTQModel), 4- or 8-bit, read as published.

Per linear layer of ``K`` inputs and ``N`` outputs, with ``P = 32 // bits`` values per word and
``G = ceil(K / group_size)`` groups (``group_size = -1``: one group)::

    qweight  int32 [K/P, N]   packed along the input dimension, low bits first
    qzeros   int32 [G, N/P]   packed along the output dimension
    scales   fp16  [G, N]
    g_idx    int32 [K]        the group of input k: k // group_size, or any grouping (desc_act)

    W[n, k] = scales[g, n] * (q[k, n] - (z[g, n] + zero_offset)),   g = g_idx[k]

``zero_offset`` is 1 in the original format (``checkpoint_format`` "gptq": zeros stored minus
one) and 0 in "gptq_v2". With desc_act every fused shard must carry the same g_idx (they share
their input, so GPTQ's activation order is the same for all of them).

``apply`` runs the fused Triton dequantize-GEMM on CUDA. On the CPU it dequantizes and multiplies
(nothing dequantized is kept between calls), except for 4-bit weights with bfloat16 activations
and few rows, which go through torch's packed-int4 kernel (tandem.quant.cpu_int4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.interfaces import QuantMethod
from tandem.quant import cpu_int4
from tandem.quant.packing import unpack_int32, values_per_word
from tandem.quant.quantize_args import CHECKPOINT_FORMATS
from tandem.quant.sharding import add_param, check_loaded, copy_checked, copy_shard, init_shards, unknown_tensor

TENSORS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True, slots=True)
class GPTQConfig:
    bits: int = 4
    group_size: int = 128
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: str = "gptq"

    def __post_init__(self) -> None:
        values_per_word(self.bits)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"unsupported GPTQ checkpoint_format {self.checkpoint_format!r}; "
                             f"supported: {', '.join(CHECKPOINT_FORMATS)}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"GPTQ group_size must be positive or -1, got {self.group_size}")

    @classmethod
    def from_dict(cls, qcfg: dict[str, Any]) -> GPTQConfig:
        """From config.json's quantization_config (GPTQModel also spells the format ``format``)."""
        return cls(
            bits=int(qcfg.get("bits", 4)),
            group_size=int(qcfg.get("group_size", 128)),
            desc_act=bool(qcfg.get("desc_act", False)),
            sym=bool(qcfg.get("sym", True)),
            checkpoint_format=qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq",
        )

    @property
    def zero_offset(self) -> int:
        return CHECKPOINT_FORMATS[self.checkpoint_format]

    def groups(self, input_size: int) -> tuple[int, int]:
        """(group size, number of groups) for a layer of ``input_size`` inputs."""
        size = input_size if self.group_size == -1 else self.group_size
        return size, -(-input_size // size)


class GPTQLinearMethod(QuantMethod):
    name = "gptq"

    def __init__(self, config: GPTQConfig | None = None) -> None:
        self.config = config or GPTQConfig()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> GPTQLinearMethod:
        return cls(GPTQConfig.from_dict(quant_config))

    def create_weights(self, layer: Any, input_size: int, output_sizes: list[int], params_dtype: Any) -> None:
        per_word = values_per_word(self.config.bits)
        if input_size % per_word or any(n % per_word for n in output_sizes):
            raise ValueError(f"{self.config.bits}-bit GPTQ needs sizes that are multiples of {per_word}, "
                             f"got {input_size} inputs and outputs {output_sizes}")
        group_size, num_groups = self.config.groups(input_size)
        out = sum(output_sizes)
        init_shards(layer, output_sizes)
        add_param(layer, "qweight", torch.zeros(input_size // per_word, out, dtype=torch.int32))
        add_param(layer, "qzeros", torch.zeros(num_groups, out // per_word, dtype=torch.int32))
        add_param(layer, "scales", torch.zeros(num_groups, out, dtype=torch.float16))
        add_param(layer, "g_idx", torch.arange(input_size, dtype=torch.int32) // group_size)
        layer.group_size = group_size
        layer.contiguous_groups = True
        layer.params_dtype = params_dtype
        layer.cpu_int4 = None

    def load_weight(self, layer: Any, name: str, tensor: Any, shard: int = 0) -> None:
        per_word = values_per_word(self.config.bits)
        if name == "qweight":
            copy_shard(layer, name, tensor, shard, dim=1)
        elif name == "qzeros":
            copy_shard(layer, name, tensor, shard, dim=1, per_element=per_word)
        elif name == "scales":
            copy_shard(layer, name, tensor, shard, dim=1)
        elif name == "g_idx":
            self._load_g_idx(layer, tensor, shard)
        else:
            raise unknown_tensor("GPTQ", name, TENSORS)

    def split_axis(self, name: str, dim: str) -> tuple[int, int] | None:
        # qweight [in/8, out], qzeros [groups, out/8], scales [groups, out], g_idx [in]
        per_word = values_per_word(self.config.bits)
        if dim == "output":
            return {"qweight": (1, 1), "qzeros": (1, per_word), "scales": (1, 1)}.get(name)
        if name == "qweight":
            return 0, per_word
        if name == "g_idx":
            return 0, 1
        return None if self.config.group_size == -1 else (0, self.config.group_size)

    def split_tensor(self, name: str, tensor: Any, split: Any, logical_size: int) -> Any:
        part = super().split_tensor(name, tensor, split, logical_size)
        if name != "g_idx" or split.dim != "input" or self.config.group_size == -1:
            return part
        # A rank keeps groups [index * G/parts, (index + 1) * G/parts): its rows must use only
        # those (always true without act order; act order may mix groups across ranks).
        groups = logical_size // self.config.group_size // split.parts
        local = part.to(torch.int64) - split.index * groups
        if local.numel() and (local.min() < 0 or local.max() >= groups):
            raise ValueError(f"g_idx: the act-order (desc_act) groups of inputs {split.index * part.numel()}.."
                             f"{(split.index + 1) * part.numel() - 1} are not all in this rank's {groups} "
                             f"groups; this layer cannot be split {split.parts} ways")
        return local.to(tensor.dtype)

    @staticmethod
    def _load_g_idx(layer: Any, tensor: torch.Tensor, shard: int) -> None:
        earlier = [s for n, s in layer.loaded_tensors if n == "g_idx"]
        if earlier and not torch.equal(tensor.to(layer.g_idx.dtype), layer.g_idx.data):
            raise ValueError(f"g_idx of shard {shard} differs from that of shard {earlier[0]}: the fused "
                             "projections of one input must share their GPTQ activation order")
        copy_checked(layer, "g_idx", layer.g_idx.data, tensor, shard)

    def process_weights_after_loading(self, layer: Any) -> None:
        check_loaded(layer, "GPTQ", ("qweight", "qzeros", "scales") + (("g_idx",) if self.config.desc_act else ()))
        num_groups = layer.scales.shape[0]
        g_idx = layer.g_idx.data
        if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= num_groups):
            raise ValueError(f"g_idx holds groups outside [0, {num_groups})")
        natural = torch.arange(g_idx.numel(), dtype=g_idx.dtype, device=g_idx.device) // layer.group_size
        layer.contiguous_groups = bool(torch.equal(g_idx, natural)) and layer.input_size % layer.group_size == 0
        if self.config.bits == 4 and layer.params_dtype == torch.bfloat16 and layer.qweight.device.type == "cpu":
            zeros = unpack_int32(layer.qzeros, 4, dim=1).float() + self.config.zero_offset
            layer.cpu_int4 = cpu_int4.pack(unpack_int32(layer.qweight, 4, dim=0), zeros, layer.scales,
                                           g_idx, layer.group_size)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            from tandem.kernels.int4_dequant_gemm import gptq_gemm

            out = gptq_gemm(x.reshape(-1, x.shape[-1]), layer.qweight, layer.qzeros, layer.scales,
                            layer.g_idx, self.config.bits, self.config.zero_offset)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        if cpu_int4.usable(layer.cpu_int4, x):
            return cpu_int4.matmul(x, layer.cpu_int4, bias)
        weight = gptq_dequantize(layer.qweight, layer.qzeros, layer.scales, layer.g_idx, self.config.bits,
                                 self.config.zero_offset,
                                 layer.group_size if layer.contiguous_groups else None, x.dtype)
        return F.linear(x, weight, bias)


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, zero_offset: int, group_size: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``W [N, K]`` (``F.linear``'s orientation; a transposed view) in ``dtype``,
    computed in float32. ``group_size`` given means ``g_idx[k] == k // group_size`` with K a
    multiple of it (groups broadcast without a gather); None gathers through ``g_idx``."""
    w = unpack_int32(qweight, bits, dim=0).float()                        # [K, N]
    zeros = unpack_int32(qzeros, bits, dim=1).float() + zero_offset       # [G, N]
    s = scales.float()
    k, n = w.shape
    if group_size is None:
        idx = g_idx.long()
        w.sub_(zeros[idx]).mul_(s[idx])
    else:
        grouped = w.view(k // group_size, group_size, n)
        grouped.sub_(zeros.unsqueeze(1)).mul_(s.unsqueeze(1))
    return w.t().to(dtype)
