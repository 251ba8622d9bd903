"""FP8 checkpoints — quant_method "fp8" packed by the tests' own packer, and compressed-tensors'
float-quantized format written by the compressed-tensors package — load into tandem and compute
what HF transformers computes on the dequantized weights (its own FP8 and compressed-tensors
readers included)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tandem.models.layers import LinearLayer
from tandem.quant.compressed_tensors import fp8_config_from_compressed_tensors
from tandem.quant.fp8 import FP8Config, FP8LinearMethod
from tests.helpers.tiny_models import hf_model
from tests.quant.formats import build_pair
from tests.quant.oracle import hf_greedy, hf_logits, load_quantized, prompts, tandem_greedy, tandem_logits
from tests.quant.published import compressed_fp8_dequantized, fp8_block_through_transformers, write_compressed_fp8

# Same dequantized float32 weights on both sides: only the summation order differs.
ATOL = 1e-4

CASES = {
    "per_tensor": dict(scales="tensor"),
    "per_tensor-static": dict(scales="tensor", static=True),
    "per_channel": dict(scales="channel"),
    "block32": dict(scales="block", block=32),
    "block48-ragged": dict(scales="block", block=48),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_on_the_dequantized_weights(case):
    quantized, dequantized = build_pair("llama", "fp8", **CASES[case])
    model, arch = load_quantized(quantized)
    hf = hf_model(dequantized)
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(hf, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("case", ["per_tensor", "block48-ragged"])
def test_greedy_output_is_identical_to_hf_generate(case):
    quantized, dequantized = build_pair("llama", "fp8", **CASES[case])
    assert tandem_greedy(quantized, prompts()) == hf_greedy(dequantized, prompts())


def test_transformers_fp8_reader_agrees():
    quantized, _ = build_pair("qwen2", "fp8", **CASES["block32"])
    model, arch = load_quantized(quantized)
    published = fp8_block_through_transformers(quantized)
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(published, ids), atol=ATOL, rtol=ATOL)


def test_fused_projection_keeps_one_scale_per_shard():
    quantized, _ = build_pair("llama", "fp8", **CASES["per_tensor-static"])
    model, _ = load_quantized(quantized)
    ckpt = load_file(quantized / "model.safetensors")
    qkv = model.model.layers[0].self_attn.qkv_proj
    parts = [f"model.layers.0.self_attn.{p}_proj." for p in "qkv"]
    rows = torch.cat([ckpt[p + "weight_scale"].expand(ckpt[p + "weight"].shape[0]) for p in parts])
    assert len({float(ckpt[p + "weight_scale"]) for p in parts}) == 3
    assert torch.equal(qkv.weight_scale[:, 0], rows)
    assert torch.equal(qkv.input_scale, torch.stack([ckpt[p + "input_scale"] for p in parts]))
    assert torch.equal(qkv.weight.view(torch.uint8),
                       torch.cat([ckpt[p + "weight"] for p in parts]).view(torch.uint8))


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_float_quantized_checkpoint_matches_its_own_reader(tmp_path, strategy):
    path = write_compressed_fp8("llama", tmp_path / "ct", strategy, static_inputs=strategy == "tensor")
    model, arch = load_quantized(path)
    assert type(model.model.layers[0].mlp.gate_up_proj.quant_method).name == "compressed-tensors"
    published = compressed_fp8_dequantized(path)
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(published, ids), atol=ATOL, rtol=ATOL)


def test_compressed_tensors_greedy_output_is_identical_to_its_reader(tmp_path):
    path = write_compressed_fp8("qwen2", tmp_path / "ct", "channel")
    published = compressed_fp8_dequantized(path)
    published.save_pretrained(tmp_path / "dequantized")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / "dequantized" / name).write_bytes((path / name).read_bytes())
    assert tandem_greedy(path, prompts()) == hf_greedy(tmp_path / "dequantized", prompts())


def test_compressed_tensors_config_maps_onto_fp8_and_refuses_the_rest():
    group = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
    cfg = fp8_config_from_compressed_tensors({"config_groups": {"group_0": group}})
    assert cfg == FP8Config("static", (128, 128), "weight_scale")
    int4 = {**group, "format": "pack-quantized", "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}
    with pytest.raises(ValueError, match="unsupported compressed-tensors format 'pack-quantized'"):
        fp8_config_from_compressed_tensors({"config_groups": {"group_0": int4}})
    with pytest.raises(ValueError, match="exactly one config group"):
        fp8_config_from_compressed_tensors({"config_groups": {"a": group, "b": group}})


def _layer(config: FP8Config, sizes: list[int]) -> LinearLayer:
    return LinearLayer(64, sizes, bias=False, quant_method=FP8LinearMethod(config))


def test_an_unquantized_weight_or_a_wrong_scale_shape_is_refused():
    layer = _layer(FP8Config(), [32, 32])
    with pytest.raises(ValueError, match="expected float8_e4m3fn"):
        layer.load("weight", torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"expected one value \(per tensor\) or \[32, 1\]"):
        layer.load("weight_scale", torch.ones(2, 1), shard=1)
    blocks = _layer(FP8Config(weight_block_size=(16, 48)), [32, 8])
    with pytest.raises(ValueError, match=r"expected \(1, 2\) for 16×48 blocks"):
        blocks.load("weight_scale_inv", torch.ones(2, 2), shard=1)
    with pytest.raises(ValueError, match="no tensor 'weight_scale_inv'"):
        layer.load("weight_scale_inv", torch.ones(1, 1))


def test_a_missing_scale_is_named():
    layer = _layer(FP8Config(activation_scheme="static"), [32])
    layer.load("weight", torch.zeros(32, 64, dtype=torch.float8_e4m3fn))
    layer.load("weight_scale", torch.tensor(0.5))
    with pytest.raises(ValueError, match="lacks input_scale of shard 0"):
        layer.quant_method.process_weights_after_loading(layer)
