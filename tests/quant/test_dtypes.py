"""Quantized layers in a bfloat16 model: the torch path dequantizes in float32 and multiplies in
the model's dtype, so the logits stay close to HF's float32 logits on the dequantized weights."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import hf_model
from tests.quant.formats import build_pair
from tests.quant.oracle import hf_logits, load_quantized, prompts, tandem_logits


@pytest.mark.parametrize("fmt,opts", [("gptq", dict(bits=4, group_size=32)), ("awq", dict(group_size=32)),
                                      ("fp8", dict(scales="block", block=32))])
def test_bfloat16_model_stays_close_to_float32_hf(fmt, opts):
    quantized, dequantized = build_pair("llama", fmt, **opts)
    model, arch = load_quantized(quantized, dtype=torch.bfloat16)
    ids = prompts()[0]
    ours = tandem_logits(model, arch, ids, dtype=torch.bfloat16)
    ref = hf_logits(hf_model(dequantized), ids)
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
