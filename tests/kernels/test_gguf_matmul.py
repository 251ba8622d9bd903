"""tandem.kernels.cpu_ops.gguf_linear / gguf_dequantize_rows (kernels/cpu/gguf_matmul.cpp)
against gguf's numpy dequantizer followed by a float64 matmul."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES

from tandem.device import cpu_flags
from tandem.kernels import cpu_ops
from tandem.kernels.gguf_types import BLOCKS
from tests.kernels.gguf_blocks import dequantized, packed

TYPES = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    assert cpu_ops.load(), "the CPU kernels build on this machine"


def in_features(ggml_type: T, blocks: int = 2) -> int:
    return GGML_QUANT_SIZES[ggml_type][0] * blocks


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def test_block_table_is_ggufs():
    assert {T(t).name for t in BLOCKS} == {t.name for t in TYPES}
    for ggml_type, block in BLOCKS.items():
        assert (block.elems, block.bytes) == GGML_QUANT_SIZES[T(ggml_type)]
        assert block.name == T(ggml_type).name


@pytest.mark.parametrize("m", [1, 3, 16, 33])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_float32_matches_dequantized_matmul(ggml_type, m, gen):
    k, n = in_features(ggml_type), 37  # N: not a multiple of the 4- or 16-row groups
    qweight = packed(ggml_type, n, k)
    x = torch.randn(m, k, generator=gen)
    y = cpu_ops.gguf_linear(x, qweight, int(ggml_type), k)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert_matches(y, x.double() @ dequantized(qweight, ggml_type).T, rtol=1e-5)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_bfloat16_matches_dequantized_matmul(ggml_type, gen):
    k, n = in_features(ggml_type), 21
    qweight = packed(ggml_type, n, k)
    x = torch.randn(5, k, generator=gen).bfloat16()
    y = cpu_ops.gguf_linear(x, qweight, int(ggml_type), k)
    assert y.dtype == torch.bfloat16
    assert_matches(y, x.double() @ dequantized(qweight, ggml_type).T, rtol=1e-2)


needs_dpbf16 = pytest.mark.skipif(not (cpu_ops.load() and cpu_ops.dpbf16_supported()),
                                  reason="the few-rows bfloat16 kernel (gguf_dpbf16.cpp) needs AVX512-BF16")


needs_vnni = pytest.mark.skipif(not {"avx512_vnni", "avx512bw", "avx512vl"} <= cpu_flags(),
                                reason="the int8 kernel (gguf_dpbf16.cpp's linear_int8) needs AVX512-VNNI")
INT8_TYPES = TYPES


@pytest.fixture
def int8_off():
    """gguf_linear's few bfloat16 rows on the bfloat16 kernel, not the int8 one."""
    previous = cpu_ops.use_gguf_int8(False)
    yield
    cpu_ops.use_gguf_int8(previous)


def fixed_point(x: torch.Tensor) -> torch.Tensor:
    """x's rows as linear_int8 takes them, in float64: each 32-value group rounded (half to even)
    to a multiple of step = 2^(e - 13), 2^e <= the group's largest |x| < 2^(e + 1) (e >= -100)."""
    groups = x.double().reshape(x.shape[0], -1, 32)
    top = groups.abs().amax(dim=-1, keepdim=True)
    e = torch.floor(torch.log2(top.clamp_min(2.0 ** -126))).clamp_min(-100)
    step = torch.pow(2.0, e - 13)
    return (torch.round(groups / step) * step).reshape(x.shape)


def assert_rounded_once(y: torch.Tensor, ref: torch.Tensor) -> None:
    """y is ref rounded to bfloat16 once, within float32's sums."""
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)  # bfloat16's spacing at ref
    err = (y.double() - ref).abs()
    assert (err <= 0.5 * ulp + 1e-5 * ref.abs().max()).all(), (err / ulp).max()


@needs_vnni
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_one_to_three_bfloat16_rows_multiply_x_in_fixed_point(ggml_type, m, gen):
    """linear_int8 (1 to 3 rows of bfloat16 x, AVX512-VNNI): each output is the
    float64 product of x in 15-bit fixed point a group (fixed_point) and the dequantized weight,
    rounded to bfloat16 once; K of 19 blocks (3 of the K-quants), N not a multiple of the tiles, a
    group of zeros and one of large values beside small ones (rounded off)."""
    k, n = in_features(ggml_type, 19 if GGML_QUANT_SIZES[ggml_type][0] == 32 else 3), 39
    qweight = packed(ggml_type, n, k, seed=m)
    x = torch.randn(m, k, generator=gen)
    x[0, :32] = 0.0
    x[-1, 32:64] *= torch.pow(2.0, torch.arange(32) % 12)  # 1 .. 2^11 in one group
    x = x.bfloat16()
    y = cpu_ops.gguf_linear(x, qweight, int(ggml_type), k)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = fixed_point(x) @ dequantized(qweight, ggml_type).T
    assert_rounded_once(y, ref)


@needs_vnni
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_row_that_is_not_finite_goes_to_the_bfloat16_kernel(bad, gen):
    k = in_features(T.Q8_0, 4)
    qweight = packed(T.Q8_0, 21, k)
    x = torch.randn(2, k, generator=gen)
    x[1, 40] = bad
    x = x.bfloat16()
    y = cpu_ops.gguf_linear(x, qweight, int(T.Q8_0), k)
    previous = cpu_ops.use_gguf_int8(False)
    try:
        expected = cpu_ops.gguf_linear(x, qweight, int(T.Q8_0), k)
    finally:
        cpu_ops.use_gguf_int8(previous)
    torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert not y[1].isfinite().all()
    assert_rounded_once(y[:1], x[:1].double() @ dequantized(qweight, T.Q8_0).T)  # the finite row: exact x


@needs_dpbf16
@pytest.mark.usefixtures("int8_off")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 12])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_few_bfloat16_rows_round_the_exact_product_once(ggml_type, m, gen):
    """gguf_dpbf16.cpp's bfloat16 kernel (bfloat16 x, up to 12 rows): every tile shape of rows and
    output rows, K of more than 16 blocks (the scales' gather and its tail): each output is the
    float64 product of the bfloat16 inputs and the dequantized weight rounded to bfloat16 once,
    within float32's sums (bfloat16 products of small integer q are exact)."""
    blocks = 19 if GGML_QUANT_SIZES[ggml_type][0] == 32 else 3
    k, n = in_features(ggml_type, blocks), 39
    qweight = packed(ggml_type, n, k, seed=m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = cpu_ops.gguf_linear(x, qweight, int(ggml_type), k)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert_rounded_once(y, x.double() @ dequantized(qweight, ggml_type).T)


@needs_dpbf16
@pytest.mark.parametrize("m", [13, 40, 129])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_many_bfloat16_rows_multiply_the_dequantized_bfloat16_weight(ggml_type, m, gen):
    """More than 12 rows of bfloat16 x: slices of W turned into bfloat16 pair panels for
    linear_dpbf16.cpp's kernels (AMX where the CPU has it). Each output is the float64 product
    of x and the weight a dequantized bfloat16 model holds (float32 dequantization rounded to
    nearest even), rounded to bfloat16 once; N = 1001 spans several slices and a ragged panel."""
    k = in_features(ggml_type, 18 if GGML_QUANT_SIZES[ggml_type][0] == 32 else 2)
    qweight = packed(ggml_type, 1001, k, seed=m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    y = cpu_ops.gguf_linear(x, qweight, int(ggml_type), k)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 1001)
    weight = dequantized(qweight, ggml_type).float().bfloat16().double()
    assert_rounded_once(y, x.double() @ weight.T)


@needs_dpbf16
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
def test_few_bfloat16_rows_agree_with_the_float32_kernel_over_threads(ggml_type, gen):
    k, n = 768 if ggml_type != T.Q6_K else 1024, 1001  # shares of many groups, a ragged last one
    qweight = packed(ggml_type, n, k)
    x = torch.randn(3, k, generator=gen).bfloat16()
    few = cpu_ops.gguf_linear(x, qweight, int(ggml_type), k).double()
    wide = cpu_ops.gguf_linear(x.float(), qweight, int(ggml_type), k).double()  # gguf_matmul.cpp's kernel
    torch.testing.assert_close(few, wide, rtol=2**-8, atol=1e-5 * wide.abs().max().item())


@pytest.mark.parametrize("m", [1, 16])
def test_many_rows_over_threads(m, gen):
    k, n = 576, 1001  # many groups shared out over the threads, a ragged last one
    qweight = packed(T.Q4_1, n, k)
    x = torch.randn(m, k, generator=gen)
    assert_matches(cpu_ops.gguf_linear(x, qweight, int(T.Q4_1), k),
                   x.double() @ dequantized(qweight, T.Q4_1).T, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_the_embedding_lookup(ggml_type, dtype):
    k, n = in_features(ggml_type), 9
    qweight = packed(ggml_type, n, k)
    rows = torch.tensor([5, 0, 8, 5])
    out = cpu_ops.gguf_dequantize_rows(qweight, int(ggml_type), k, rows, dtype)
    assert out.dtype == dtype and out.shape == (4, k)
    expected = dequantized(qweight, ggml_type)[rows]
    tol = 1e-6 if dtype == torch.float32 else 2**-8  # float32 values may round to either bfloat16 neighbour
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_dequantize_rows_refuses_a_row_out_of_range():
    qweight = packed(T.Q8_0, 4, 32)
    with pytest.raises(IndexError, match="row 4 out of range"):
        cpu_ops.gguf_dequantize_rows(qweight, int(T.Q8_0), 32, torch.tensor([0, 4]), torch.float32)


@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.F16])
def test_refuses_a_type_without_kernel(ggml_type):
    qweight = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"ggml type {int(ggml_type)} \({ggml_type.name}\); supported: Q4_0, Q4_1"):
        cpu_ops.gguf_linear(torch.zeros(1, 256), qweight, int(ggml_type), 256)
    with pytest.raises(ValueError, match=ggml_type.name):
        cpu_ops.gguf_dequantize_rows(qweight, int(ggml_type), 256, torch.tensor([0]), torch.float32)


def test_refuses_rows_of_the_wrong_length():
    qweight = packed(T.Q4_K, 3, 512)
    with pytest.raises(ValueError, match="qweight rows hold 287 bytes, expected 288 for in_features=512 of Q4_K"):
        cpu_ops.gguf_linear(torch.zeros(1, 512), qweight[:, :-1].contiguous(), int(T.Q4_K), 512)
    with pytest.raises(ValueError, match="in_features=500 must be a positive multiple of Q4_K's block of 256"):
        cpu_ops.gguf_linear(torch.zeros(1, 500), qweight, int(T.Q4_K), 500)


def test_refuses_x_of_another_width():
    qweight = packed(T.Q8_0, 3, 64)
    with pytest.raises(ValueError, match=r"x must be a float32 or bfloat16 CPU tensor \[M, in_features=64\]"):
        cpu_ops.gguf_linear(torch.zeros(2, 32), qweight, int(T.Q8_0), 64)
