"""GPTQ checkpoints (packed by the tests' own packer, tests/quant/formats.py) load into tandem and
compute what HF transformers computes on the same weights dequantized to float32."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tandem.models.layers import LinearLayer
from tandem.quant.gptq import GPTQConfig, GPTQLinearMethod
from tests.helpers.tiny_models import hf_model
from tests.quant.formats import build_pair
from tests.quant.oracle import hf_greedy, hf_logits, load_quantized, prompts, tandem_greedy, tandem_logits

# Same dequantized weights on both sides: only the float32 summation order differs.
ATOL = 1e-4

CASES = {
    "4bit-sym-v1": dict(bits=4, group_size=32, sym=True),
    "4bit-asym-v2": dict(bits=4, group_size=32, sym=False, v2=True),
    "4bit-asym-v1-desc_act": dict(bits=4, group_size=16, sym=False, desc_act=True),
    "8bit-sym-v1-per_channel": dict(bits=8, group_size=-1, sym=True),
    "8bit-asym-v2": dict(bits=8, group_size=64, sym=False, v2=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf_on_the_dequantized_weights(case):
    quantized, dequantized = build_pair("llama", "gptq", **CASES[case])
    model, arch = load_quantized(quantized)
    hf = hf_model(dequantized)
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(hf, ids), atol=ATOL, rtol=ATOL)


def test_qkv_biases_load_beside_the_quantized_weights():
    quantized, dequantized = build_pair("qwen2", "gptq", bits=4, group_size=32, sym=False)
    model, arch = load_quantized(quantized)
    ids = prompts()[0]
    torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(hf_model(dequantized), ids),
                               atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("case", ["4bit-sym-v1", "4bit-asym-v1-desc_act"])
def test_greedy_output_is_identical_to_hf_generate(case):
    quantized, dequantized = build_pair("llama", "gptq", **CASES[case])
    assert tandem_greedy(quantized, prompts()) == hf_greedy(dequantized, prompts())


def test_fused_projection_keeps_each_shard_packed_side_by_side():
    quantized, _ = build_pair("llama", "gptq", **CASES["4bit-asym-v2"])
    model, _ = load_quantized(quantized)
    ckpt = load_file(quantized / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj
    parts = [f"model.layers.1.self_attn.{p}_proj." for p in "qkv"]
    assert torch.equal(qkv.qweight, torch.cat([ckpt[p + "qweight"] for p in parts], dim=1))
    assert torch.equal(qkv.qzeros, torch.cat([ckpt[p + "qzeros"] for p in parts], dim=1))
    assert torch.equal(qkv.scales, torch.cat([ckpt[p + "scales"] for p in parts], dim=1))
    assert qkv.qweight.dtype == torch.int32 and qkv.scales.dtype == torch.float16
    assert not any(p.dtype.is_floating_point and p.element_size() > 2 for p in qkv.parameters())


def _layer(config: GPTQConfig, sizes: list[int]) -> LinearLayer:
    return LinearLayer(64, sizes, bias=False, quant_method=GPTQLinearMethod(config))


def test_fused_shards_with_different_activation_orders_are_rejected():
    layer = _layer(GPTQConfig(group_size=16, desc_act=True), [32, 32])
    first = (torch.arange(64, dtype=torch.int32) // 16).flip(0)
    layer.load("g_idx", first, shard=0)
    with pytest.raises(ValueError, match="g_idx of shard 1 differs"):
        layer.load("g_idx", torch.arange(64, dtype=torch.int32) // 16, shard=1)


def test_a_missing_tensor_is_named():
    layer = _layer(GPTQConfig(group_size=16), [32, 32])
    for shard in (0, 1):
        layer.load("qweight", torch.zeros(8, 32, dtype=torch.int32), shard)
        layer.load("scales", torch.ones(4, 32, dtype=torch.float16), shard)
    layer.load("qzeros", torch.zeros(4, 4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="lacks qzeros of shard 1"):
        layer.quant_method.process_weights_after_loading(layer)


def test_a_wrong_shape_or_an_unquantized_weight_is_refused():
    layer = _layer(GPTQConfig(group_size=16), [32])
    with pytest.raises(ValueError, match=r"qweight of shard 0 has shape \(8, 16\), expected \(8, 32\)"):
        layer.load("qweight", torch.zeros(8, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="unquantized layer"):
        layer.load("weight", torch.zeros(32, 64))


def test_config_reads_the_published_keys():
    cfg = GPTQConfig.from_dict({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True,
                                "sym": False, "checkpoint_format": "gptq_v2"})
    assert (cfg.bits, cfg.group_size, cfg.desc_act, cfg.sym, cfg.zero_offset) == (8, -1, True, False, 0)
    assert GPTQConfig.from_dict({"bits": 4, "format": "gptq_v2"}).zero_offset == 0
    assert GPTQConfig.from_dict({"bits": 4}).zero_offset == 1
    with pytest.raises(ValueError, match="unsupported GPTQ checkpoint_format 'marlin'"):
        GPTQConfig.from_dict({"bits": 4, "checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="3-bit"):
        GPTQConfig.from_dict({"bits": 3})
