"""The fused dequantize-GEMM kernel (GPTQ and AWQ layouts) against its torch reference and the
quant methods' torch path, on layers packed by the tests' own packer. On a CPU it runs in
Triton's interpreter (small shapes); on a GPU on CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tandem.quant.awq import awq_dequantize
from tandem.quant.gptq import gptq_dequantize
from tests.quant.formats import awq_layer, gptq_layer

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.5, size=(n, k)).astype(np.float32)


def _to(tensors: dict, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(v)).to(device) for name, v in tensors.items()}


def _x(m: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(device, dtype)


@pytest.mark.parametrize("m,k,n", [(3, 64, 48), (17, 72, 80)])
@pytest.mark.parametrize("bits,v2,desc_act", [(4, False, False), (4, True, True), (8, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gptq_kernel_matches_the_reference_and_the_torch_path(kernel_device, m, k, n, bits, v2, desc_act, dtype):
    from tandem.kernels.int4_dequant_gemm import gptq_gemm, gptq_gemm_reference

    layer, dequantized = gptq_layer(_weights(n, k, bits), np.random.default_rng(1), bits=bits, group_size=16,
                                    sym=False, v2=v2, desc_act=desc_act)
    t = _to(layer, kernel_device)
    x = _x(m, k, dtype, kernel_device)
    zero_offset = 0 if v2 else 1
    out = gptq_gemm(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, zero_offset)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = gptq_gemm_reference(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, zero_offset)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    cpu = {name: v.cpu() for name, v in t.items()}
    weight = gptq_dequantize(cpu["qweight"], cpu["qzeros"], cpu["scales"], cpu["g_idx"], bits, zero_offset,
                             None, torch.float32)
    assert torch.equal(weight, torch.from_numpy(dequantized))
    torch_path = F.linear(x.cpu().float(), weight.to(dtype).float()).to(dtype)
    torch.testing.assert_close(out.cpu(), torch_path, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("m,k,n,group_size", [(5, 64, 48, 32), (20, 96, 72, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_awq_kernel_matches_the_reference_and_the_torch_path(kernel_device, m, k, n, group_size, dtype):
    from tandem.kernels.int4_dequant_gemm import awq_gemm, awq_gemm_reference

    layer, dequantized = awq_layer(_weights(n, k, 5), np.random.default_rng(2), group_size=group_size)
    t = _to(layer, kernel_device)
    x = _x(m, k, dtype, kernel_device)
    out = awq_gemm(x, t["qweight"], t["qzeros"], t["scales"], group_size)
    ref = awq_gemm_reference(x, t["qweight"], t["qzeros"], t["scales"], group_size)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    cpu = {name: v.cpu() for name, v in t.items()}
    weight = awq_dequantize(cpu["qweight"], cpu["qzeros"], cpu["scales"], group_size, torch.float32)
    assert torch.equal(weight, torch.from_numpy(dequantized))
    torch_path = F.linear(x.cpu().float(), weight.to(dtype).float()).to(dtype)
    torch.testing.assert_close(out.cpu(), torch_path, atol=TOL[dtype], rtol=TOL[dtype])


def test_an_empty_batch_gives_an_empty_output(kernel_device):
    from tandem.kernels.int4_dequant_gemm import awq_gemm

    layer, _ = awq_layer(_weights(16, 32, 0), np.random.default_rng(0), group_size=32)
    t = _to(layer, kernel_device)
    out = awq_gemm(torch.zeros(0, 32, device=kernel_device), t["qweight"], t["qzeros"], t["scales"], 32)
    assert out.shape == (0, 16)


def test_launchers_refuse_mismatched_arguments(kernel_device):
    from tandem.kernels.int4_dequant_gemm import awq_gemm, gptq_gemm

    layer, _ = gptq_layer(_weights(16, 32, 0), np.random.default_rng(0), group_size=16)
    t = _to(layer, kernel_device)
    x = torch.zeros(2, 32, device=kernel_device)
    with pytest.raises(ValueError, match="qweight has shape"):
        gptq_gemm(torch.zeros(2, 40, device=kernel_device), t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 1)
    with pytest.raises(ValueError, match="g_idx has dtype"):
        gptq_gemm(x, t["qweight"], t["qzeros"], t["scales"], t["g_idx"].long(), 4, 1)
    with pytest.raises(ValueError, match="x has dtype"):
        gptq_gemm(x.double(), t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 4, 1)
    with pytest.raises(ValueError, match="multiple of group_size"):
        awq_gemm(torch.zeros(2, 48, device=kernel_device), t["qweight"], t["qzeros"], t["scales"], 32)
