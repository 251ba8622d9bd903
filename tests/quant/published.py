"""Published readers of the quantized formats, run on this CPU beside torch 2.13, as oracles:

- compressed-tensors' ``AutoAWQConverter`` turns an AutoAWQ GEMM checkpoint into its own
  pack-quantized format, which HF transformers then loads dequantized;
- HF transformers loads an "fp8" checkpoint with 128×128-style block scales (``weight_scale_inv``)
  dequantized on a CPU (its FineGrainedFP8 integration; needs accelerate);
- compressed-tensors writes FP8 checkpoints in its float-quantized format (``write_compressed_fp8``)
  and HF transformers loads them dequantized.

Each returns an HF model in float32 whose linear layers hold the reader's dequantized weights.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from tests.helpers.tiny_models import hf_model, tiny_model_dir


def _load_dequantized(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the checkpoint's quantization_config will be used"
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    return model.eval()


def awq_through_compressed_tensors(awq_dir: Path, out_dir: Path) -> torch.nn.Module:
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    convert_checkpoint(awq_dir, out_dir, AutoAWQConverter.from_pretrained(str(awq_dir)), device="cpu")
    return _load_dequantized(out_dir)


def fp8_block_through_transformers(fp8_dir: Path) -> torch.nn.Module:
    """HF's own FP8 reader; block sizes must divide the weights' shapes."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32).eval()


def write_compressed_fp8(kind: str, out_dir: Path, strategy: str, static_inputs: bool = False,
                         block: int = 32) -> Path:
    """Quantize tiny model ``kind`` to FP8 with compressed-tensors' own scheme, scale and
    compressor (strategy "tensor", "channel" or "block"), and save it in its float-quantized
    format; static input scales, when asked, are arbitrary positive numbers."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = hf_model(tiny_model_dir(kind))
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False,
                               block_structure=[block, block] if strategy == "block" else None)
    inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                              strategy="tensor" if static_inputs else "token", dynamic=not static_inputs)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                low, high = _ranges(module.weight, strategy, block)
                scale, _ = calculate_qparams(low, high, weights)
                module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
                if static_inputs:
                    module.input_scale.fill_(0.02)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out_dir)
    compressor.update_config(out_dir)
    tokenizer_dir = tiny_model_dir(kind)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out_dir


def _ranges(weight: torch.Tensor, strategy: str, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    if strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    rows, cols = weight.shape
    blocks = weight.reshape(rows // block, block, cols // block, block)
    return blocks.amin((1, 3)), blocks.amax((1, 3))


def compressed_fp8_dequantized(path: Path) -> torch.nn.Module:
    return _load_dequantized(path)
