"""GPTQ and AWQ 4-bit layers with bfloat16 activations on the CPU go through torch's packed-int4
matmul (tandem.quant.cpu_int4) for few rows; the result is checked against the weights the
tests' own numpy packer dequantizes (tests/quant/formats.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.models.layers import LinearLayer
from tandem.quant import cpu_int4
from tandem.quant.awq import AWQConfig, AWQLinearMethod
from tandem.quant.gptq import GPTQConfig, GPTQLinearMethod
from tests.quant.formats import awq_layer, build_pair, gptq_layer
from tests.quant.oracle import load_quantized, prompts, tandem_logits

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="torch lacks the CPU int4 kernel")

GPTQ_CASES = {
    "sym-v1-g32": dict(bits=4, group_size=32, sym=True),
    "asym-v2-g128": dict(bits=4, group_size=128, sym=False, v2=True),
    "asym-v1-g64-desc_act": dict(bits=4, group_size=64, sym=False, desc_act=True),
}


def _bf16_layer(k: int, n: int, method) -> LinearLayer:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LinearLayer(k, [n], bias=True, quant_method=method)
    finally:
        torch.set_default_dtype(previous)


def _load(layer: LinearLayer, tensors: dict, bias: torch.Tensor) -> None:
    for name, value in tensors.items():
        layer.load(name, torch.from_numpy(np.ascontiguousarray(value)))
    layer.load("bias", bias)
    layer.quant_method.process_weights_after_loading(layer)


def _check(layer: LinearLayer, weight: np.ndarray, bias: torch.Tensor, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, layer.input_size, generator=gen).to(torch.bfloat16)
    expected = x.double() @ torch.from_numpy(weight).double().T + bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16
    err = (got.double() - expected).norm() / expected.norm()
    assert err < 1e-2, err  # bf16 scales, zeros and output rounding; a wrong zero point gives ~1


def _case(builder, k: int, n: int, **opts):
    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)
    tensors, weight = builder(w, rng, **opts)
    return tensors, weight, torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
@pytest.mark.parametrize("rows", [1, 7, cpu_int4.MAX_ROWS, cpu_int4.MAX_ROWS + 1])
def test_gptq_layer(case, rows):
    opts = GPTQ_CASES[case]
    tensors, weight, bias = _case(gptq_layer, 256, 96, **opts)
    config = GPTQConfig(bits=4, group_size=opts["group_size"], sym=opts["sym"], desc_act=opts.get("desc_act", False),
                        checkpoint_format="gptq_v2" if opts.get("v2") else "gptq")
    layer = _bf16_layer(256, 96, GPTQLinearMethod(config))
    _load(layer, tensors, bias)
    assert layer.cpu_int4 is not None
    assert (layer.cpu_int4.perm is not None) == opts.get("desc_act", False)
    x = torch.zeros(rows, 256, dtype=torch.bfloat16)
    assert cpu_int4.usable(layer.cpu_int4, x) == (rows <= cpu_int4.MAX_ROWS)
    _check(layer, weight, bias, rows)


@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 33])
def test_awq_layer(group_size, rows):
    tensors, weight, bias = _case(awq_layer, 128, 64, group_size=group_size)
    layer = _bf16_layer(128, 64, AWQLinearMethod(AWQConfig(group_size=group_size)))
    _load(layer, tensors, bias)
    assert layer.cpu_int4 is not None
    _check(layer, weight, bias, rows)


def test_unsuited_layers_fall_back_to_dequantizing():
    # group size 16 (the kernel takes 32..256), 40 outputs (not a multiple of 16), uneven groups
    tensors, weight, bias = _case(gptq_layer, 64, 32, bits=4, group_size=16, sym=True)
    layer = _bf16_layer(64, 32, GPTQLinearMethod(GPTQConfig(group_size=16)))
    _load(layer, tensors, bias)
    assert layer.cpu_int4 is None
    _check(layer, weight, bias, 3)
    q, z, s = torch.zeros(64, 40, dtype=torch.uint8), torch.zeros(2, 40), torch.ones(2, 40)
    assert cpu_int4.pack(q, z, s, None, 32) is None
    uneven = torch.tensor([0] * 40 + [1] * 24)
    assert cpu_int4.pack(q[:, :32], z[:, :32], s[:, :32], uneven, 32) is None


def test_float32_models_keep_the_dequantizing_path():
    tensors, weight, bias = _case(gptq_layer, 64, 32, bits=4, group_size=32, sym=True)
    layer = LinearLayer(64, [32], bias=True, quant_method=GPTQLinearMethod(GPTQConfig(group_size=32)))
    _load(layer, tensors, bias.float())
    assert layer.cpu_int4 is None


@pytest.mark.parametrize("fmt, opts", [("gptq", dict(bits=4, group_size=32, sym=False)),
                                       ("awq", dict(group_size=32))])
def test_bf16_model_logits_follow_the_float32_ones(fmt, opts):
    """A whole bfloat16 model (decode steps through the int4 kernel) against the same checkpoint
    in float32 (dequantizing path, itself checked against HF in test_gptq/test_awq)."""
    quantized, _ = build_pair("llama", fmt, **opts)
    model, arch = load_quantized(quantized, dtype=torch.bfloat16)
    assert all(m.cpu_int4 is not None for m in model.modules() if isinstance(m, LinearLayer))
    ref_model, _ = load_quantized(quantized)
    for ids in prompts():
        got = tandem_logits(model, arch, ids, dtype=torch.bfloat16).float()
        ref = tandem_logits(ref_model, arch, ids)
        assert ((got - ref).norm() / ref.norm()) < 3e-2
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
