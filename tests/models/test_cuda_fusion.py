"""The models with the CUDA path's fused RMSNorm (tandem's Triton kernel, run here on the CPU in
Triton's interpreter; on a GPU machine on CUDA too) against HF transformers' forward logits, and
in bfloat16 within test_model_vs_hf's bound of float32 HF, as torch's norm is. Gemma's norm
stays on torch."""
from __future__ import annotations

import os

import pytest
import torch

from tandem.models.cuda_fusion import enable_cuda_fusion
from tandem.models.layers import GemmaRMSNorm, RMSNorm
from tests.helpers.tiny_models import load_tiny_model, tiny_model_dir
from tests.models.test_model_vs_hf import ATOL, hf_logits, models, prompt
from tests.quant.oracle import tandem_logits

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
        "a Triton kernel runs on CPU tensors only in Triton's interpreter (tests/conftest.py sets "
        "it where there is no GPU)"))),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def load(kind: str, dtype: torch.dtype, device: str, fuse: bool):
    model, arch = load_tiny_model(tiny_model_dir(kind), dtype=dtype, device=device)
    if fuse:
        norms = [m for m in model.modules() if type(m) is RMSNorm]
        assert enable_cuda_fusion(model) == len(norms) > 0
    return model, arch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3"])
def test_logits_match_hf_with_the_triton_norm(kind, device):
    model, arch = load(kind, torch.float32, device, fuse=True)
    ids = prompt()
    atol = ATOL if device == "cpu" else 1e-3  # TF32-free float32 on CUDA still sums in another order
    torch.testing.assert_close(tandem_logits(model, arch, ids, device),
                               hf_logits(models(kind)[2], ids), atol=atol, rtol=atol)


def test_gemma_keeps_torchs_norm():
    model, _ = load_tiny_model(tiny_model_dir("gemma3"))
    enable_cuda_fusion(model)
    gemma_norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    assert gemma_norms and all(m.kernel is None for m in gemma_norms)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_stays_as_close_to_float32_hf_as_torchs_norm(device):
    """As test_model_vs_hf's bfloat16 check: the same roundings as torch's norm, only the order
    of the float32 sum of squares differs, which may flip a bfloat16 rounding here and there."""
    ids = prompt()
    ref = hf_logits(models("llama")[2], ids)
    fused, plain = (tandem_logits(*load("llama", torch.bfloat16, device, fuse), ids, device, torch.bfloat16)
                    for fuse in (True, False))
    bound = 0.05 * ref.abs().max()
    assert (plain - ref).abs().max() < bound
    assert (fused - ref).abs().max() < bound
