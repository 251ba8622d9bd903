"""Quantized checkpoints under tensor parallelism: GPTQ, AWQ and FP8 tensors are cut along the
same dimensions as dense ones, at group, packed-word and scale-block boundaries. The oracle is
HF transformers' greedy ``generate`` on the dequantized weights (tests/quant/formats.py); what
cannot split is refused at start-up with a message naming the layer and the shape."""
from __future__ import annotations

import pytest

from tandem import LLM
from tests.engine.test_greedy_vs_hf import _prompts, hf_greedy, tandem_greedy
from tests.quant.formats import build_pair

pytestmark = pytest.mark.timeout(600)

PROMPTS = _prompts(11, [3, 17, 40])


@pytest.mark.parametrize("fmt,opts", [
    ("gptq", dict(bits=4, group_size=32, sym=True)),
    ("gptq", dict(bits=8, group_size=-1, sym=True)),
    ("awq", {}),
    ("fp8", dict(scales="channel")),
    ("fp8", dict(scales="block", block=16)),
])
def test_greedy_matches_hf_on_the_dequantized_weights_at_tp2(fmt, opts):
    quantized, dequantized = build_pair("llama", fmt, **opts)
    llm = LLM(model=str(quantized), num_kv_blocks=64, tensor_parallel_size=2, worker_timeout_s=120)
    try:
        got = [o.outputs[0].token_ids for o in tandem_greedy(llm, PROMPTS)]
    finally:
        llm.engine.close()
    assert got == hf_greedy(dequantized, PROMPTS)


@pytest.mark.parametrize("fmt,opts,match", [
    # K and V have 32 outputs each: 16 per rank is not a whole 32-row scale block
    ("fp8", dict(scales="block", block=32),
     r"model\.layers\.0\.self_attn\.qkv_proj .*k_proj\.weight_scale_inv.*shape \(1, 2\).*32 outputs do not split"),
    # act order mixes groups across the halves of the down projection's inputs
    ("gptq", dict(bits=4, group_size=16, sym=False, desc_act=True),
     r"model\.layers\.0\.\w+\.\w+_proj .*g_idx.*cannot be split 2 ways"),
])
def test_what_cannot_split_is_refused_naming_the_layer_and_shape(fmt, opts, match):
    quantized, _ = build_pair("llama", fmt, **opts)
    with pytest.raises(RuntimeError, match=match):
        LLM(model=str(quantized), num_kv_blocks=64, tensor_parallel_size=2, worker_timeout_s=120)
