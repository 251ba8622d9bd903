"""The Gemma 3 and q/k-norm passes of kernels/cpu/elementwise.cpp against HF transformers' own
modules (``Gemma3RMSNorm``, ``Qwen3RMSNorm``) and torch's tanh GELU: float32 within float32
rounding, bfloat16 within one bfloat16 step and nearly always equal (the sums of squares run in
another order than torch's)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from tandem.kernels import cpu_ops


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    assert cpu_ops.load(), "the CPU kernels build on this machine"


EPS = 1e-6


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> None:
    """Equal within the dtype's rounding, and (bfloat16) nearly all exactly equal."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=max(atol, 1e-5), rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=2 ** -7)
    sizable = want.abs() > 1e-3  # where the reference itself is accurate (see the GELU test)
    assert (got == want)[sizable].float().mean() > 0.99


def hf_norm(cls, width: int, weight: torch.Tensor) -> torch.nn.Module:
    norm = cls(width, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
    return norm.to(weight.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_and_its_residual_add_match_hf(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 640, generator=g) * 30).to(dtype)  # Gemma's residual stream is large
    h = torch.randn(7, 640, generator=g).to(dtype)
    weight = torch.randn(640, generator=g).to(dtype)
    hf = hf_norm(Gemma3RMSNorm, 640, weight)
    out = torch.empty_like(x)
    cpu_ops.gemma_rms_norm(out, x, weight, EPS)
    with torch.no_grad():
        close(out, hf(x))
        want = x + hf(h)
    residual = x.clone()
    cpu_ops.gemma_add_rms_norm(residual, h, weight, EPS)
    close(residual, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("gemma", "cls"), [(False, Qwen3RMSNorm), (True, Gemma3RMSNorm)])
def test_head_norm_works_in_place_on_the_q_and_k_views_of_a_projection(dtype, gemma, cls):
    heads, kv_heads, d, tokens = 4, 2, 32, 5
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 4).to(dtype)
    wq, wk = torch.randn(d, generator=g).to(dtype), torch.randn(d, generator=g).to(dtype)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)  # strided rows
    cpu_ops.head_rms_norm(qk[:, :heads], wq, EPS, gemma)
    cpu_ops.head_rms_norm(qk[:, heads:], wk, EPS, gemma)
    with torch.no_grad():
        want_q = hf_norm(cls, d, wq)(before[:, : heads * d].view(tokens, heads, d))
        want_k = hf_norm(cls, d, wk)(before[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d))
    close(qk[:, :heads], want_q)
    close(qk[:, heads:], want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_matches_torch_even_far_out(dtype):
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(9, 300, generator=g) * 3
    gate[0, :6] = torch.tensor([-1e4, -60.0, -12.0, 12.0, 60.0, 1e4])  # tanh saturated both ways
    up = torch.randn(9, 300, generator=g)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    out = torch.empty(9, 300, dtype=dtype)
    cpu_ops.gelu_tanh_and_mul(out, gate_up)
    gate, up = gate_up.split(300, dim=1)
    assert torch.isfinite(out).all()
    # in the negative tail torch's 1 + tanh(y) is 0 or a few float32 rounding steps (it cancels),
    # the kernel's x / (1 + exp(-2y)) is not: absolute differences there, of that size
    close(out, F.gelu(gate, approximate="tanh") * up, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 37])
def test_silu_and_mul_matches_torch_even_far_out(dtype, width):
    """SiLU-and-mul against torch's ``F.silu(gate) * up``, 16 values at a time where the build
    has AVX512 (a width that is not a multiple of 16 ends in a masked part), out to where torch's
    exp(-x) overflows: there its x / inf is -0 (and -inf / inf a NaN), not a tiny negative."""
    g = torch.Generator().manual_seed(3)
    gate = torch.randn(5, width, generator=g) * 4
    far = [-float("inf"), -3.0e38, -1e4, -100.0, -88.0, -20.0, -0.0, 0.0, 20.0, 100.0, 3.0e38, float("inf")]
    gate[0, :len(far)] = torch.tensor(far)[:width]
    gate[1, -len(far):] = torch.tensor(far)[-width:]
    up = torch.randn(5, width, generator=g)
    gate_up = torch.cat([gate, up], dim=1).to(dtype)
    out = torch.empty(5, width, dtype=dtype)
    cpu_ops.silu_and_mul(out, gate_up)
    gate, up = gate_up.split(width, dim=1)
    want = F.silu(gate) * up
    assert torch.equal(out.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(out.signbit()[finite & (want == 0)], want.signbit()[finite & (want == 0)])
    close(out.masked_fill(~finite, 0), want.masked_fill(~finite, 0), atol=1e-30)


def test_wrong_shapes_are_refused_naming_the_kernel():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="gemma_rms_norm"):
        cpu_ops.gemma_rms_norm(torch.empty(3, 8), x, torch.randn(7), EPS)
    with pytest.raises(RuntimeError, match="head_rms_norm"):
        cpu_ops.head_rms_norm(x.view(3, 2, 4), torch.randn(8), EPS, True)
    with pytest.raises(RuntimeError, match="gelu_tanh_and_mul"):
        cpu_ops.gelu_tanh_and_mul(torch.empty(3, 5), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_shared_over_threads_give_each_rows_own_values(dtype):
    """Past a few tens of thousands of values a pass is shared out over the work pool: every row
    gets the values it gets alone (a decode step's one-row call, done on the calling thread),
    and torch's within rounding (the Llama passes: RMSNorm, the residual add, SiLU-and-mul,
    rotary)."""
    g = torch.Generator().manual_seed(3)
    rows, width, heads, d = 300, 576, 6, 64
    x = torch.randn(rows, width, generator=g).to(dtype)
    residual = torch.randn(rows, width, generator=g).to(dtype)
    weight = torch.randn(width, generator=g).to(dtype)
    gate_up = torch.randn(rows, 2 * width, generator=g).to(dtype)
    q = torch.randn(rows, heads, d, generator=g).to(dtype)
    angles = torch.rand(rows, d // 2, generator=g) * 100
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)

    def passes(r: slice) -> list[torch.Tensor]:
        normed = torch.empty_like(x[r])
        cpu_ops.rms_norm(normed, x[r].contiguous(), weight, EPS)
        added, res = x[r].clone(), residual[r].clone()
        cpu_ops.add_rms_norm(added, res, weight, EPS)
        act = torch.empty(gate_up[r].shape[0], width, dtype=dtype)
        cpu_ops.silu_and_mul(act, gate_up[r].contiguous())
        rotated = q[r].clone()
        cpu_ops.rotary_neox(rotated, cos[r].contiguous(), sin[r].contiguous())
        return [normed, added, res, act, rotated]

    together = passes(slice(None))
    alone = [torch.cat(parts) for parts in zip(*(passes(slice(i, i + 1)) for i in range(rows)))]
    for got, want in zip(together, alone):
        assert torch.equal(got, want)
    summed = (x.float() + residual.float()).to(dtype)
    reference = [weight * F.rms_norm(x.float(), (width,), eps=EPS).to(dtype),
                 weight * F.rms_norm(summed.float(), (width,), eps=EPS).to(dtype), summed,
                 F.silu(gate_up[:, :width]) * gate_up[:, width:],
                 q * cos[:, None] + torch.cat((-q[..., d // 2:], q[..., :d // 2]), -1) * sin[:, None]]
    for got, want in zip(together, reference):
        close(got, want, atol=1e-5 if dtype == torch.float32 else 2 ** -6)
    if dtype == torch.bfloat16:  # rotary rounds each product and the sum as torch does: exactly its values
        assert torch.equal(together[4], reference[4])


def test_bfloat16_rounding_keeps_nans_and_infinities_as_torch_does():
    """The passes round on the bits: a NaN stays a NaN, an infinity stays itself,
    a value past bfloat16's largest becomes infinity — torch's values wherever torch's is not
    a NaN, and a NaN wherever it is (rotary, SiLU-and-mul)."""
    q = torch.tensor([0x7FFF, 0x7FC1, 0xFFFF, 0x7F80, 0x7F7F, 0x3F80, 0xC000, 0x4040], dtype=torch.int32).to(torch.int16)
    q = q.view(torch.bfloat16).view(1, 1, 8)
    cos = torch.tensor([[0.5, 2.0, -1.0, 0.25] * 2]).bfloat16()
    sin = torch.tensor([[2.0, 0.5, 3.0, -2.0] * 2]).bfloat16()
    got = q.clone()
    cpu_ops.rotary_neox(got, cos, sin)
    want = q * cos[:, None] + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin[:, None]
    gate_up = torch.cat([q.view(1, 8), q.view(1, 8).flip(-1)], -1)
    act = torch.empty(1, 8, dtype=torch.bfloat16)
    cpu_ops.silu_and_mul(act, gate_up)
    act_want = F.silu(gate_up[:, :8]) * gate_up[:, 8:]
    for g, w in ((got, want), (act, act_want)):
        assert torch.equal(g.isnan(), w.isnan()) and g.isnan().any()
        assert torch.equal(g[~w.isnan()], w[~w.isnan()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 7, 2048])
def test_copy_rows_is_index_copy(dtype, n):
    """A step's K rows (a slice of the qkv product, strided) into scattered rows of a pool view
    whose rows are strided too: torch's index_copy_ is the oracle; small calls run serially, a
    prompt's 2,048 rows on the work pool."""
    gen = torch.Generator().manual_seed(n)
    qkv = torch.randn(n, 960, generator=gen).to(dtype)
    src = qkv[:, 576:768].view(n, 3, 64)  # rows 960 values apart
    pool = torch.randn(3000, 2, 3, 64, generator=gen).to(dtype)
    dst = pool[:, 1]  # rows 384 values apart, each one contiguous run
    index = torch.randperm(3000, generator=gen)[:n]
    want, keys = dst.clone().index_copy_(0, index, src), pool[:, 0].clone()
    cpu_ops.copy_rows(dst, index, src)
    assert torch.equal(dst, want)
    assert torch.equal(pool[:, 0], keys)  # the rows between dst's rows untouched


def test_copy_rows_refuses_a_bad_index_before_copying_and_rows_that_are_not_one_run():
    dst, src = torch.zeros(4, 8), torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.copy_rows(dst, torch.tensor([1, 4]), src)
    assert not dst.any()  # row 1 was not written either
    with pytest.raises(RuntimeError, match="contiguous run"):
        cpu_ops.copy_rows(dst, torch.tensor([0, 1]), torch.ones(8, 2).t())
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ops.copy_rows(dst, torch.tensor([0, 1]), src.double())
