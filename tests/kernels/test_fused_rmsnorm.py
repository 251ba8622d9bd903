"""rms_norm (with and without the fused residual add) against its torch reference, and the
reference against HF's LlamaRMSNorm."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tandem.kernels.fused_rmsnorm import rms_norm, rms_norm_reference

from .paged_inputs import tolerances

EPS = 1e-5


def _inputs(rows, hidden, dtype, device, gen):
    """x as a strided view (every other row of a wider buffer), residual and weight."""
    x = torch.randn(2 * rows, hidden + 8, generator=gen)[::2, :hidden]
    residual = torch.randn(rows, hidden, generator=gen)
    weight = 1 + 0.5 * torch.randn(hidden, generator=gen)
    return (t.to(device=device, dtype=dtype) for t in (x, residual, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_hf_llama_rmsnorm(dtype, gen):
    x, residual, weight = _inputs(5, 64, dtype, torch.device("cpu"), gen)
    hf = LlamaRMSNorm(64, eps=EPS).to(dtype)
    hf.weight.data.copy_(weight)
    expected_sum = x + residual
    out, new_residual = rms_norm_reference(x, weight, EPS, residual.clone())
    assert torch.equal(new_residual, expected_sum)
    assert torch.equal(out, hf(expected_sum))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 96, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(dtype, hidden, with_residual, device, gen):
    x, residual, weight = _inputs(7, hidden, dtype, device, gen)
    expected_residual = residual.clone() if with_residual else None
    expected, _ = rms_norm_reference(x, weight, EPS, expected_residual)
    out = torch.full((7, hidden), float("nan"), dtype=dtype, device=device)
    got, got_residual = rms_norm(x, weight, EPS, residual if with_residual else None, out=out)
    assert got is out
    torch.testing.assert_close(out, expected, **tolerances(dtype))
    if with_residual:
        assert got_residual is residual
        torch.testing.assert_close(residual, expected_residual, **tolerances(dtype))
    else:
        assert got_residual is x


def test_allocates_output_when_none_given(device, gen):
    x, residual, weight = _inputs(3, 64, torch.float32, device, gen)
    out, _ = rms_norm(x, weight, EPS)
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS)[0], **tolerances(torch.float32))


def test_rejects_bad_arguments(device, gen):
    x, residual, weight = _inputs(3, 64, torch.float16, device, gen)
    with pytest.raises(ValueError, match="weight has dtype"):
        rms_norm(x, weight.float(), EPS)
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm(x, weight, EPS, residual[:2])
