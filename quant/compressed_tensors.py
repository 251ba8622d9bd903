"""compressed-tensors checkpoints (quant_method "compressed-tensors") with FP8 weights, in its
"float-quantized" (or "naive-quantized") format, read as the compressed-tensors package writes
them: the same tensors as the "fp8" method's, except that block scales are also named
``weight_scale``::

    weight        float8_e4m3fn [N, K]
    weight_scale  float32 [1] (strategy "tensor"), [N, 1] ("channel") or
                  [ceil(N/bn), ceil(K/bk)] ("block", block_structure [bn, bk])
    input_scale   float32 [1] when input_activations are static (dynamic: none)

quantization_config names one config group of FP8 weights (num_bits 8, type float, symmetric)
targeting the Linear layers; the layers it ignores must be outside tandem's quantized linear
layers (the LM head). Loading and matmuls are ``tandem.quant.fp8.FP8LinearMethod``'s.
"""
from __future__ import annotations

from typing import Any

from tandem.quant.fp8 import FP8Config, FP8LinearMethod

FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("tensor", "channel", "block")


class CompressedTensorsFP8Method(FP8LinearMethod):
    name = "compressed-tensors"

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> CompressedTensorsFP8Method:
        return cls(fp8_config_from_compressed_tensors(quant_config))


def fp8_config_from_compressed_tensors(qcfg: dict[str, Any]) -> FP8Config:
    """The FP8Config equivalent to a compressed-tensors quantization_config; ValueError for the
    schemes tandem does not read."""
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors checkpoints need exactly one config group, got {len(groups)}")
    group = next(iter(groups.values()))
    fmt = group.get("format") or qcfg.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"unsupported compressed-tensors format {fmt!r}; supported: {', '.join(FORMATS)} "
                         "with FP8 weights")
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors checkpoint has quantization_status {status!r}, expected 'compressed'")
    if "Linear" not in (group.get("targets") or []):
        raise ValueError(f"the config group targets {group.get('targets')}, expected ['Linear']")
    return FP8Config(activation_scheme=_activation_scheme(group.get("input_activations")),
                     weight_block_size=_weight_blocks(group.get("weights") or {}),
                     block_scale_name="weight_scale")


def _weight_blocks(weights: dict[str, Any]) -> tuple[int, int] | None:
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors weights of type {weights.get('type')!r} with "
                         f"{weights.get('num_bits')} bits are not supported: only 8-bit float (FP8)")
    if not weights.get("symmetric", True) or weights.get("dynamic"):
        raise ValueError("FP8 weights must be symmetric and statically scaled")
    strategy = weights.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"unsupported FP8 weight strategy {strategy!r}; supported: {', '.join(STRATEGIES)}")
    if strategy != "block":
        return None
    block_n, block_k = weights["block_structure"]
    return int(block_n), int(block_k)


def _activation_scheme(acts: dict[str, Any] | None) -> str:
    if not acts or acts.get("dynamic", True):
        return "dynamic"
    if acts.get("strategy") != "tensor":
        raise ValueError(f"static input activations need strategy 'tensor', got {acts.get('strategy')!r}")
    return "static"
