"""tandem.kernels.gguf_matmul.gguf_linear_triton (CUDA, or Triton's interpreter on a CPU)
against gguf's numpy dequantizer followed by a float64 matmul; tiny shapes, as the interpreter
is slow."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from tandem.kernels.gguf_matmul import gguf_linear_triton
from tests.kernels.gguf_blocks import dequantized, packed

TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


def oracle(x: torch.Tensor, qweight: torch.Tensor, ggml_type: T) -> torch.Tensor:
    return x.double().cpu() @ dequantized(qweight, ggml_type).T


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_float32_matches_dequantized_matmul(ggml_type, device, gen):
    k = 2 * GGML_QUANT_SIZES[ggml_type][0] if GGML_QUANT_SIZES[ggml_type][0] == 32 else 256
    qweight = packed(ggml_type, 40, k)  # N=40: a part-filled 64-column tile
    x = torch.randn(3, k, generator=gen)
    y = gguf_linear_triton(x.to(device), qweight.to(device), int(ggml_type), k)
    assert y.dtype == torch.float32 and y.shape == (3, 40)
    ref = oracle(x, qweight, ggml_type)
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_16_bit_x_over_two_row_tiles(device, gen):
    # float16: Triton's interpreter has no bfloat16 dot; the kernel's 16-bit path is the same
    qweight = packed(T.Q4_K, 24, 256)
    x = torch.randn(17, 256, generator=gen).half()  # 17 rows: a 32-row tile, part-filled
    y = gguf_linear_triton(x.to(device), qweight.to(device), int(T.Q4_K), 256)
    assert y.dtype == torch.float16
    ref = oracle(x, qweight, T.Q4_K)
    torch.testing.assert_close(y.cpu().double(), ref, rtol=4e-3, atol=4e-3 * ref.abs().max().item())


def test_refuses_a_type_without_kernel_and_rows_of_the_wrong_length(device):
    x = torch.zeros(1, 256, device=device)
    with pytest.raises(ValueError, match=r"ggml type 11 \(Q3_K\); supported: Q4_0"):
        gguf_linear_triton(x, torch.zeros(2, 110, dtype=torch.uint8, device=device), int(T.Q3_K), 256)
    with pytest.raises(ValueError, match="qweight rows hold 143 bytes, expected 144"):
        gguf_linear_triton(x, torch.zeros(2, 143, dtype=torch.uint8, device=device), int(T.Q4_K), 256)
