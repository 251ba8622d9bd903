"""AWQ checkpoints in AutoAWQ's GEMM layout (4-bit, with zero points), read as published.

Per linear layer of ``K`` inputs and ``N`` outputs, ``G = K / group_size`` groups::

    qweight  int32 [K, N/8]   packed along the output dimension in AutoAWQ's interleaved order
    qzeros   int32 [G, N/8]   the same packing
    scales   fp16  [G, N]

    W[n, k] = scales[k // group_size, n] * (q[k, n] - z[k // group_size, n])

where nibble ``j`` of word ``c`` holds column ``8c + (0, 2, 4, 6, 1, 3, 5, 7)[j]`` (see
``tandem.quant.packing``). Zero points are stored as they are (no +1 as in GPTQ v1).

``apply`` runs the fused Triton dequantize-GEMM on CUDA. On the CPU it dequantizes and multiplies
(nothing dequantized is kept between calls), except for bfloat16 activations with few rows, which
go through torch's packed-int4 kernel (tandem.quant.cpu_int4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.interfaces import QuantMethod
from tandem.quant import cpu_int4
from tandem.quant.packing import AWQ_NIBBLE_OF_COLUMN, AWQ_PACK_ORDER, unpack_int32_planes
from tandem.quant.sharding import add_param, check_loaded, copy_shard, init_shards, unknown_tensor

PACK = 8
TENSORS = ("qweight", "qzeros", "scales")


@dataclass(frozen=True, slots=True)
class AWQConfig:
    group_size: int = 128

    @classmethod
    def from_dict(cls, qcfg: dict[str, Any]) -> AWQConfig:
        """From config.json's quantization_config (HF's spelling or AutoAWQ's ``w_bit`` /
        ``q_group_size``); only 4-bit GEMM checkpoints with zero points are supported."""
        bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
        version = str(qcfg.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ supports 4-bit weights only, the checkpoint has {bits}")
        if version != "gemm":
            raise ValueError(f"unsupported AWQ version {version!r}: only the GEMM layout is supported")
        if not qcfg.get("zero_point", True):
            raise ValueError("AWQ checkpoints without zero points (zero_point = false) are not supported")
        group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", 128)))
        if group_size < 1:
            raise ValueError(f"AWQ group_size must be positive, got {group_size}")
        return cls(group_size=group_size)


class AWQLinearMethod(QuantMethod):
    name = "awq"

    def __init__(self, config: AWQConfig | None = None) -> None:
        self.config = config or AWQConfig()

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> AWQLinearMethod:
        return cls(AWQConfig.from_dict(quant_config))

    def create_weights(self, layer: Any, input_size: int, output_sizes: list[int], params_dtype: Any) -> None:
        group_size = self.config.group_size
        if input_size % group_size or any(n % PACK for n in output_sizes):
            raise ValueError(f"AWQ needs inputs that are a multiple of group_size {group_size} and outputs "
                             f"that are multiples of {PACK}, got {input_size} inputs and outputs {output_sizes}")
        out = sum(output_sizes)
        num_groups = input_size // group_size
        init_shards(layer, output_sizes)
        add_param(layer, "qweight", torch.zeros(input_size, out // PACK, dtype=torch.int32))
        add_param(layer, "qzeros", torch.zeros(num_groups, out // PACK, dtype=torch.int32))
        add_param(layer, "scales", torch.zeros(num_groups, out, dtype=torch.float16))
        layer.params_dtype = params_dtype
        layer.cpu_int4 = None

    def load_weight(self, layer: Any, name: str, tensor: Any, shard: int = 0) -> None:
        if name in ("qweight", "qzeros"):
            copy_shard(layer, name, tensor, shard, dim=1, per_element=PACK)
        elif name == "scales":
            copy_shard(layer, name, tensor, shard, dim=1)
        else:
            raise unknown_tensor("AWQ", name, TENSORS)

    def split_axis(self, name: str, dim: str) -> tuple[int, int] | None:
        # qweight [in, out/8], qzeros [in/group, out/8], scales [in/group, out]
        if dim == "output":
            return (1, 1) if name == "scales" else (1, PACK)
        return (0, 1) if name == "qweight" else (0, self.config.group_size)

    def process_weights_after_loading(self, layer: Any) -> None:
        check_loaded(layer, "AWQ", TENSORS)
        if layer.params_dtype == torch.bfloat16 and layer.qweight.device.type == "cpu":
            k, num_groups = layer.qweight.shape[0], layer.qzeros.shape[0]
            q = natural_columns(unpack_int32_planes(layer.qweight, 4).view(k, -1))
            zeros = natural_columns(unpack_int32_planes(layer.qzeros, 4).view(num_groups, -1))
            layer.cpu_int4 = cpu_int4.pack(q, zeros, layer.scales, None, self.config.group_size)

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            from tandem.kernels.int4_dequant_gemm import awq_gemm

            out = awq_gemm(x.reshape(-1, x.shape[-1]), layer.qweight, layer.qzeros, layer.scales,
                           self.config.group_size)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        if cpu_int4.usable(layer.cpu_int4, x):
            return cpu_int4.matmul(x, layer.cpu_int4, bias)
        weight = weight_in_nibble_order(layer.qweight, layer.qzeros, layer.scales, self.config.group_size)
        out = natural_columns(F.linear(x, weight.to(x.dtype).t()))
        return out if bias is None else out + bias


def weight_in_nibble_order(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                           group_size: int) -> torch.Tensor:
    """``W.T [K, N]`` in float32 with its columns in nibble order — column ``j*(N/8) + c`` is output
    ``8c + AWQ_PACK_ORDER[j]`` — which unpacks with contiguous writes only; ``natural_columns``
    puts the outputs of a matmul with it back in order."""
    k, words = qweight.shape
    num_groups = qzeros.shape[0]
    w = unpack_int32_planes(qweight, 4).float().view(k, -1)                     # [K, N], nibble order
    zeros = unpack_int32_planes(qzeros, 4).float().view(num_groups, -1)         # [G, N], nibble order
    s = scales.float().view(num_groups, words, 8)[:, :, list(AWQ_PACK_ORDER)].transpose(1, 2)
    s = s.reshape(num_groups, -1)                                               # [G, N], nibble order
    w.view(num_groups, group_size, -1).sub_(zeros.unsqueeze(1)).mul_(s.unsqueeze(1))
    return w


def natural_columns(y: torch.Tensor) -> torch.Tensor:
    """The last dimension from nibble order (see ``weight_in_nibble_order``) to natural order."""
    index = torch.tensor(AWQ_NIBBLE_OF_COLUMN, device=y.device)
    return y.unflatten(-1, (8, y.shape[-1] // 8)).index_select(-2, index).transpose(-1, -2).flatten(-2)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The weight ``W [N, K]`` (``F.linear``'s orientation) in ``dtype``, computed in float32."""
    return natural_columns(weight_in_nibble_order(qweight, qzeros, scales, group_size)).t().to(dtype)
