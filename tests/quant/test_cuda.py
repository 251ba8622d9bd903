"""The CUDA paths of the quant methods — the Triton dequantize-GEMMs and ``torch._scaled_mm`` —
on quantized tiny models, against HF transformers on the dequantized weights (CPU, float32)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import hf_model
from tests.quant.formats import build_pair
from tests.quant.oracle import hf_logits, load_quantized, prompts, tandem_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WEIGHT_ONLY = {
    "gptq-4bit-desc_act": ("gptq", dict(bits=4, group_size=16, sym=False, desc_act=True)),
    "gptq-8bit": ("gptq", dict(bits=8, group_size=32, sym=True, v2=True)),
    "awq": ("awq", dict(group_size=32)),
    "fp8-block-ragged": ("fp8", dict(scales="block", block=48)),
}
W8A8 = {
    "fp8-tensor-static": ("fp8", dict(scales="tensor", static=True)),
    "fp8-channel-dynamic": ("fp8", dict(scales="channel")),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_ONLY))
def test_float32_kernels_match_hf_on_the_dequantized_weights(case):
    fmt, opts = WEIGHT_ONLY[case]
    quantized, dequantized = build_pair("llama", fmt, **opts)
    model, arch = load_quantized(quantized, device="cuda")
    hf = hf_model(dequantized)
    for ids in prompts():
        torch.testing.assert_close(tandem_logits(model, arch, ids, device="cuda"), hf_logits(hf, ids),
                                   atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("case", sorted(WEIGHT_ONLY) + sorted(W8A8))
def test_bfloat16_stays_close_to_hf(case):
    fmt, opts = {**WEIGHT_ONLY, **W8A8}[case]
    quantized, dequantized = build_pair("llama", fmt, **opts)
    model, arch = load_quantized(quantized, dtype=torch.bfloat16, device="cuda")
    hf = hf_model(dequantized)
    for ids in prompts():
        ours = tandem_logits(model, arch, ids, device="cuda", dtype=torch.bfloat16)
        ref = hf_logits(hf, ids)
        assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
