"""The FP8 matmuls against their torch references and the FP8 method's torch path: the Triton
W8A16 kernel (interpreter on a CPU, CUDA on a GPU) and the ``torch._scaled_mm`` W8A8 path (which
torch also runs on a CPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.quant.fp8 import e4m3_to_float32, fp8_dequantize

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def _fp8_layer(n: int, k: int, block_k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n * k)
    weight = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // block_k), generator=gen) / 100 + 1e-3
    return weight.to(device), scale.to(device)


@pytest.mark.parametrize("m,k,n,block_k", [(3, 64, 48, 64), (17, 72, 80, 32), (2, 96, 40, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_the_reference_and_the_torch_path(kernel_device, m, k, n, block_k, dtype):
    from tandem.kernels.fp8_matmul import fp8_dequant_matmul, fp8_dequant_matmul_reference

    weight, scale = _fp8_layer(n, k, block_k, kernel_device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(kernel_device, dtype)
    out = fp8_dequant_matmul(x, weight, scale, block_k)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, fp8_dequant_matmul_reference(x, weight, scale, block_k),
                               atol=TOL[dtype], rtol=TOL[dtype])
    torch_path = F.linear(x.cpu().float(), fp8_dequantize(weight.cpu(), scale.cpu(), block_k, dtype).float())
    torch.testing.assert_close(out.cpu(), torch_path.to(dtype), atol=TOL[dtype], rtol=TOL[dtype])


def test_kernel_decodes_every_finite_e4m3_value_exactly(kernel_device):
    from tandem.kernels.fp8_matmul import fp8_dequant_matmul

    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)                 # the two NaN codes
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16).to(kernel_device)
    eye = torch.eye(16, device=kernel_device)
    out = fp8_dequant_matmul(eye, weight, torch.ones(16, 1, device=kernel_device), 16)
    assert torch.equal(out.t().cpu(), weight.cpu().float())


def test_torch_path_decodes_every_finite_e4m3_value_exactly():
    codes = torch.arange(256, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes)                 # the two NaN codes
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    decoded = e4m3_to_float32(weight)
    assert torch.equal(decoded, weight.float())
    assert torch.equal(torch.signbit(decoded), torch.signbit(weight.float()))   # -0.0 stays negative


def _fp8_tensor_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not _fp8_tensor_cores(), reason="needs FP8 tensor cores")])])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_path_matches_its_reference(device, static, dtype):
    from tandem.kernels.fp8_matmul import fp8_linear, fp8_scaled_mm, fp8_scaled_mm_reference, scaled_mm_applies

    weight, scale = _fp8_layer(48, 64, 64, torch.device(device))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    input_scale = torch.tensor(0.01, device=device) if static else None
    out = fp8_scaled_mm(x, weight, scale, input_scale)
    assert out.dtype == dtype
    assert scaled_mm_applies(x, weight, scale) == (device == "cuda")
    if device == "cuda":
        torch.testing.assert_close(fp8_linear(x, weight, scale, 64, input_scale), out)
    ref = fp8_scaled_mm_reference(x.cpu(), weight.cpu(), scale.cpu(), input_scale.cpu() if static else None)
    out = out.cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_linear_uses_the_kernel_off_fp8_tensor_cores(kernel_device):
    from tandem.kernels.fp8_matmul import fp8_dequant_matmul_reference, fp8_linear, scaled_mm_applies

    weight, scale = _fp8_layer(32, 64, 32, kernel_device)
    x = torch.randn(4, 64, device=kernel_device)
    assert not scaled_mm_applies(x, weight, scale)      # block scales never take the _scaled_mm path
    torch.testing.assert_close(fp8_linear(x, weight, scale, 32, None),
                               fp8_dequant_matmul_reference(x, weight, scale, 32), atol=1e-4, rtol=1e-4)


def test_launcher_refuses_mismatched_arguments(kernel_device):
    from tandem.kernels.fp8_matmul import fp8_dequant_matmul

    weight, scale = _fp8_layer(32, 64, 32, kernel_device)
    x = torch.zeros(2, 64, device=kernel_device)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(32, 2\), expected \(32, 1\)"):
        fp8_dequant_matmul(x, weight, scale, 64)
    with pytest.raises(ValueError, match="weight has dtype"):
        fp8_dequant_matmul(x, weight.float(), scale, 32)
    with pytest.raises(ValueError, match="x has 48 columns"):
        fp8_dequant_matmul(torch.zeros(2, 48, device=kernel_device), weight, scale, 32)
