"""AutoAWQ GEMM checkpoints (packed by the tests' own packer) load into tandem and compute what HF
transformers computes on the dequantized weights — and what compressed-tensors' own AutoAWQ
reader makes of the same files."""
from __future__ import annotations

import pytest
import torch

from tandem.models.layers import LinearLayer
from tandem.quant.awq import AWQConfig, AWQLinearMethod
from tests.helpers.tiny_models import hf_model
from tests.quant.formats import build_pair
from tests.quant.oracle import hf_greedy, hf_logits, load_quantized, prompts, tandem_greedy, tandem_logits
from tests.quant.published import awq_through_compressed_tensors

ATOL = 1e-4
# compressed-tensors dequantizes in float16: logits agree to ~1e-2 (quantization moves them by ~3).
CT_ATOL = 2e-2


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("group_size", [32, 64])
def test_logits_match_hf_on_the_dequantized_weights(kind, group_size):
    quantized, dequantized = build_pair(kind, "awq", group_size=group_size)
    model, arch = load_quantized(quantized)
    hf = hf_model(dequantized)
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(hf, ids), atol=ATOL, rtol=ATOL)


def test_greedy_output_is_identical_to_hf_generate():
    quantized, dequantized = build_pair("llama", "awq", group_size=32)
    assert tandem_greedy(quantized, prompts()) == hf_greedy(dequantized, prompts())


def test_compressed_tensors_autoawq_reader_agrees(tmp_path):
    quantized, _ = build_pair("llama", "awq", group_size=32)
    model, arch = load_quantized(quantized)
    published = awq_through_compressed_tensors(quantized, tmp_path / "ct")
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids), hf_logits(published, ids),
                                   atol=CT_ATOL, rtol=0)


def test_config_reads_both_spellings_and_refuses_other_layouts():
    assert AWQConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm",
                                "zero_point": True}).group_size == 64
    assert AWQConfig.from_dict({"w_bit": 4, "q_group_size": 32, "version": "GEMM"}).group_size == 32
    with pytest.raises(ValueError, match="only the GEMM layout"):
        AWQConfig.from_dict({"bits": 4, "version": "gemv"})
    with pytest.raises(ValueError, match="4-bit"):
        AWQConfig.from_dict({"bits": 8})
    with pytest.raises(ValueError, match="zero_point"):
        AWQConfig.from_dict({"bits": 4, "zero_point": False})


def test_a_missing_tensor_is_named():
    layer = LinearLayer(64, [32, 16], bias=False, quant_method=AWQLinearMethod(AWQConfig(group_size=32)))
    layer.load("qweight", torch.zeros(64, 4, dtype=torch.int32), 0)
    layer.load("qzeros", torch.zeros(2, 4, dtype=torch.int32), 0)
    layer.load("scales", torch.ones(2, 32, dtype=torch.float16), 0)
    layer.load("qweight", torch.zeros(64, 2, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="lacks qzeros of shard 1, scales of shard 1"):
        layer.quant_method.process_weights_after_loading(layer)
