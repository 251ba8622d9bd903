"""PackedLinear (tandem's panel kernel and oneDNN's) against torch's own matmul, and what
pack_cpu_linears does to a model: which layers it packs, what it frees, the errors it gives."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tandem.config import TandemConfig
from tandem.kernels import cpu_ops
from tandem.models.cpu_linear import (
    PackedLinear,
    amx_available,
    dpbf16_available,
    pack_cpu_linears,
    resolve_kind,
    silu_pass,
)
from tandem.models.layers import LinearLayer, LMHead
from tests.helpers.tiny_models import load_tiny_model, tiny_model_dir

CPU = torch.device("cpu")
needs_dpbf16 = pytest.mark.skipif(not dpbf16_available(), reason="this CPU has no AVX512-BF16 instructions: "
                                  "the dpbf16 kernel is built but cannot run here")
needs_amx = pytest.mark.skipif(not amx_available(), reason="this CPU (or its kernel) gives no AMX-BF16 instructions: "
                               "the amx kernel is built but cannot run here")
PAIR_KERNELS = [pytest.param("dpbf16", marks=needs_dpbf16), pytest.param("amx", marks=needs_amx)]
PAIR_OPS = {"dpbf16": cpu_ops.panel_linear_dpbf16, "amx": cpu_ops.panel_linear_amx}


def reference(x, w, bias):
    """float64 products and sums of the (possibly 16-bit) values, rounded to x's dtype."""
    out = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    return out.to(x.dtype)


@pytest.mark.parametrize("kind", ["tandem", "onednn"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 64, 97, 200])
def test_packed_linear_matches_a_float64_matmul(kind, dtype, tol, rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 83, 48  # neither a multiple of the 16-column panel
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    packed = PackedLinear.pack(kind, w)
    for b in (None, bias):
        got = packed(x, b)
        assert got.dtype == dtype and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), reference(x, w, b).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [31, 32, 64, 97])
def test_16_bit_weights_over_several_k_slices(dtype, rows):
    # K = 600 spans three of the kernel's 256-row K-slices, the last one partial; from 32 rows on,
    # each slice is widened to float32 once and read by every tile (97 rows: a row block of 96
    # that does, then one of a single row that widens as it loads)
    gen = torch.Generator().manual_seed(rows)
    n, k = 50, 600
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    x = torch.randn(rows, k, generator=gen)
    got = PackedLinear.pack("tandem", w)(x)
    # x is float32: the kernel's float32 products and sums of the exact 16-bit values must be as
    # close to float64 ones as a float32 weight's are (the test above), not merely 16-bit close
    torch.testing.assert_close(got, reference(x, w, None), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 4, 31, 32, 33, 97, 200])
def test_float32_weights_over_several_k_slices_and_an_odd_panel(rows):
    # K = 600: three K-slices, the last partial; N = 67: five panels, the last partial, so that
    # panels taken two at a time (32 rows or more on AVX512 builds) leave one alone; rows not a
    # multiple of any tile
    gen = torch.Generator().manual_seed(rows)
    n, k = 67, 600
    w = torch.randn(n, k, generator=gen) / k**0.5
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    packed = PackedLinear.pack("tandem", w)
    for b in (None, bias):
        torch.testing.assert_close(packed(x, b), reference(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [3, 64, 200])
def test_the_result_does_not_depend_on_the_number_of_threads(rows):
    # Threads take panels (and row blocks) a few at a time from a shared counter: every output
    # is computed once, by one thread, the same way, so one thread and two give the same bits,
    # and none is left out (the float64 reference).
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(16 * 37 + 5, 64, generator=gen) / 8
    x = torch.randn(rows, 64, generator=gen)
    many = on_one_thread_and_more(PackedLinear.pack("tandem", w), x)
    torch.testing.assert_close(many, reference(x, w, None), atol=1e-4, rtol=1e-4)


def on_one_thread_and_more(packed, x):
    """``packed(x)`` on one thread and on two or more: the same bits (returned)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed(x)
        torch.set_num_threads(max(2, threads))
        many = packed(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    return many


def test_strided_and_batched_inputs():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 32, generator=gen)
    packed = PackedLinear.pack("tandem", w)
    wide = torch.randn(9, 96, generator=gen)
    x = wide[:, 32:64]  # rows 96 apart: a slice of a fused projection's output
    torch.testing.assert_close(packed(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    x3 = torch.randn(2, 5, 32, generator=gen)
    torch.testing.assert_close(packed(x3), F.linear(x3, w), atol=1e-5, rtol=1e-5)
    assert packed(torch.empty(0, 32)).shape == (0, 40)


@pytest.mark.parametrize("kind", ["tandem", "onednn"])
@pytest.mark.parametrize("model_kind", ["llama", "llama_tied"])
def test_packing_a_model_keeps_its_logits_and_frees_the_dense_weights(kind, model_kind):
    path = tiny_model_dir(model_kind)
    ref, _ = load_tiny_model(path)
    model, _ = load_tiny_model(path)
    assert pack_cpu_linears(model, kind, CPU) == kind
    linears = [m for m in model.modules() if isinstance(m, LinearLayer)]
    assert linears and all(m.packed is not None and m.weight is None for m in linears)
    head = model.lm_head
    assert isinstance(head, LMHead) and head.packed is not None
    if head.tied:  # the embedding still looks its rows up
        assert head.weight is model.model.embed_tokens.weight
    else:
        assert head.weight is None
    hidden = torch.randn(7, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(model.compute_logits(hidden), ref.compute_logits(hidden), atol=1e-4, rtol=1e-4)
        for ours, theirs in zip(linears, (m for m in ref.modules() if isinstance(m, LinearLayer))):
            x = torch.randn(3, theirs.input_size)
            torch.testing.assert_close(ours(x), theirs(x), atol=1e-4, rtol=1e-4)
    assert pack_cpu_linears(model, kind, CPU) == kind  # a second call changes nothing


def test_torch_mode_and_other_devices_pack_nothing():
    model, _ = load_tiny_model(tiny_model_dir("llama"))
    assert pack_cpu_linears(model, "torch", CPU) == "torch"
    assert resolve_kind("auto", torch.device("cuda")) == "torch"
    assert all(m.packed is None and m.weight is not None for m in model.modules() if isinstance(m, LinearLayer))


def test_auto_picks_tandems_kernel_here():
    assert resolve_kind("auto", CPU) == "tandem"


def test_unknown_mode_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"engine.cpu_kernels = 'fast'; allowed: auto, tandem, dpbf16, amx, onednn, torch"):
        resolve_kind("fast", CPU)
    with pytest.raises(ValueError, match="cpu_kernels"):
        TandemConfig.model_validate({"model": {"path": "x"}, "engine": {"cpu_kernels": "fast"}})


EXACT_CASES = [pytest.param("dpbf16", rows, k, marks=needs_dpbf16)
               for rows in (1, 7, 8, 9, 96, 97, 200) for k in (48, 258, 600)] + \
              [pytest.param("amx", rows, k, marks=needs_amx)
               for rows in (1, 15, 16, 17, 31, 32, 33, 64, 65, 129, 300) for k in (32, 96, 608)]


@pytest.mark.parametrize(("kernel", "rows", "k"), EXACT_CASES)
def test_pair_kernels_sum_the_exact_bfloat16_products_in_float32(kernel, rows, k):
    # Products of two bfloat16 values are exact in float32: the float32 result must be as close to
    # float64 sums of the same values as float32 arithmetic gets. dpbf16: across K-slices of 128
    # pairs (600 = 2 full and 1 partial), tiles of 8 rows and row blocks of 96; amx: tiles of 16
    # rows (a partial last one from the padded copy), blocks of 32, the shared path (<= 64 rows)
    # and chunks of 128, groups of two panels with a last one alone (7 panels)
    gen = torch.Generator().manual_seed(rows * k)
    n = 16 * 6 + 3
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    packed = PackedLinear.pack(kernel, w)
    for b in (None, bias):
        out = torch.empty(rows, n)
        PAIR_OPS[kernel](out, x, packed.weight, b)
        expected = x.double() @ w.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4)
        got = packed(x, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)


@needs_dpbf16
def test_dpbf16_rounds_its_bfloat16_outs_exactly_as_torch_converts():
    """The bfloat16 out (and the float32 out of bfloat16 values) hold the float32 sums rounded
    as torch's ``.to(torch.bfloat16)`` rounds them, bit for bit: ties to even (1 + 2^-8 down,
    1 + 2^-7 + 2^-8 up), infinities, a bias, columns past the last full panel; a NaN stays a
    NaN (its bits are not torch's: torch's own scalar and vector conversions differ there)."""
    n, k = 21, 4
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[:, 0] = w[:, 1] = 1  # column c: x0 + x1, exactly, in float32
    w[n - 3:, 2] = torch.tensor([3.0, -1.5, 2.0**-9], dtype=torch.bfloat16)
    firsts = [1.0, 1 + 2**-7, -(1 + 2**-7), 2**100, float("inf"), float("nan"), -0.0, 3.0, 2**-126]
    seconds = [2**-8, 2**-8, -(2**-8), 2**93, 1.0, 1.0, -0.0, 2**-9, 2**-134]
    x = torch.zeros(len(firsts) + 64, k)
    x[:len(firsts), 0], x[:len(firsts), 1] = torch.tensor(firsts), torch.tensor(seconds)
    x[len(firsts):] = torch.randn(64, k)
    x = x.to(torch.bfloat16)
    packed = PackedLinear.pack("dpbf16", w)
    for x, bias in itertools.product((x[:8], x[:12], x), (None, torch.randn(n))):  # a tile, two, a wide row block
        exact = torch.empty(x.shape[0], n)
        cpu_ops.panel_linear_dpbf16(exact, x, packed.weight, bias)
        rounded = exact.to(torch.bfloat16)
        out16 = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        cpu_ops.panel_linear_dpbf16(out16, x, packed.weight, bias)
        nan = rounded.isnan()
        assert nan.any() and torch.equal(out16.isnan(), nan)
        assert torch.equal(out16.view(torch.int16)[~nan], rounded.view(torch.int16)[~nan])
        widened = torch.empty(x.shape[0], n)
        cpu_ops.panel_linear_dpbf16(widened, x, packed.weight, bias, bf16_values=True)
        assert torch.equal(widened.isnan(), nan)
        assert torch.equal(widened.view(torch.int32)[~nan], rounded.float().view(torch.int32)[~nan])
        if bias is None:  # the two ties
            assert out16[0, 0].item() == 1.0 and out16[1, 0].item() == 1 + 2**-6


@pytest.mark.parametrize("kernel", PAIR_KERNELS)
def test_pair_kernels_take_strided_rows_and_any_thread_count(kernel):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16 * 37 + 5, 64, generator=gen).to(torch.bfloat16)
    wide = torch.randn(70, 192, generator=gen).to(torch.bfloat16)
    x = wide[:, 64:128]  # rows 192 apart: a slice of a fused projection's output
    many = on_one_thread_and_more(PackedLinear.pack(kernel, w), x)
    torch.testing.assert_close(many.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kernel", PAIR_KERNELS)
def test_pair_kernel_modes_pack_bfloat16_layers_and_leave_others_on_tandems_panels(kernel):
    ref, _ = load_tiny_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    model, _ = load_tiny_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    assert pack_cpu_linears(model, kernel, CPU) == kernel
    linears = [m for m in model.modules() if isinstance(m, LinearLayer)]
    assert linears and {m.packed.kind for m in linears} == {kernel}  # hidden 64, intermediate 128: K fits amx
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        ours, theirs = model.compute_logits(hidden), ref.compute_logits(hidden)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2, rtol=2e-2)
    fp32, _ = load_tiny_model(tiny_model_dir("llama"))
    assert pack_cpu_linears(fp32, kernel, CPU) == kernel
    # float32 layers: amx multiplies them as bfloat16 parts on tandem's panels; dpbf16 cannot
    want = "amx" if kernel == "amx" else "tandem"
    assert {m.packed.kind for m in fp32.modules() if isinstance(m, LinearLayer)} == {want}


AMX_F32_CASES = [(rows, k) for rows in (1, 15, 16, 17, 33, 64, 65, 300) for k in (32, 96, 608)] + [(700, 32), (600, 1024)]


@needs_amx
@pytest.mark.parametrize(("rows", "k"), AMX_F32_CASES)
def test_amx_float32_layers_are_as_exact_as_float32_arithmetic(rows, k):
    """``panel_linear_amx_f32`` splits each float32 value into three bfloat16 parts and sums six
    of their products: against float64 sums of the same float32 values it must be as close as
    torch's own float32 product is (within float32's rounding, and never more than twice
    ``F.linear``'s error) — on one tile of rows or many, the shared path (<= 64 rows) and
    chunks (K 32 and 1024: chunks of 512 and of 160 rows), groups of two panels with a last
    one alone, a last partial panel, with and without a bias."""
    gen = torch.Generator().manual_seed(rows * k)
    n = 16 * 6 + 3
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = PackedLinear.pack("amx", w)
    assert packed.weight.shape == (7, k, 16)  # tandem's panels, float32
    for b in (None, bias):
        out = torch.empty(rows, n)
        cpu_ops.panel_linear_amx_f32(out, x, packed.weight, b)
        exact = x.double() @ w.double().t() + (0 if b is None else b.double())
        ours = (out.double() - exact).abs().max().item()
        torch_error = (F.linear(x, w, b).double() - exact).abs().max().item()
        assert ours <= max(2 * torch_error, 1e-6), (ours, torch_error)
        torch.testing.assert_close(out, exact.float(), atol=1e-5, rtol=1e-5)
        assert torch.equal(packed(x, b), out)


@needs_amx
def test_amx_float32_keeps_values_of_every_magnitude():
    """The split is exact at any exponent: large and small magnitudes, values one ulp from a
    power of two, zeros — a weight times 1.0 comes back exactly (its three parts add up to it),
    and every sum is within float32's rounding of float64's."""
    k, n = 64, 17
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=gen)
    x = torch.zeros(4, k)
    x[0, :8] = torch.tensor([1e30, -3e30, 1 + 2**-23, -(1 - 2**-24), 2.0**-100, 3.0, 0.0, -0.0])
    x[1] = torch.randn(k, generator=gen) * 2.0**-60
    x[2, 0] = 1.0  # out row 2: W's column 0 exactly, each weight recomposed from its three parts
    x[3] = torch.randn(k, generator=gen)
    out = torch.empty(4, n)
    cpu_ops.panel_linear_amx_f32(out, x, PackedLinear.pack("amx", w).weight, None)
    assert torch.equal(out[2], w[:, 0])
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()  # a dot product's rounding is relative to this
    assert ((out.double() - exact).abs() <= 1e-6 * scale).all()


@needs_amx
def test_amx_float32_takes_strided_rows_and_any_thread_count():
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(16 * 37 + 5, 64, generator=gen)
    x = torch.randn(70, 192, generator=gen)[:, 64:128]
    many = on_one_thread_and_more(PackedLinear.pack("amx", w), x)
    torch.testing.assert_close(many, F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_dpbf16_mode_without_the_instructions_is_refused(monkeypatch):
    from tandem.models import cpu_linear

    monkeypatch.setattr(cpu_linear, "dpbf16_available", lambda: False)
    with pytest.raises(ValueError, match=r"cpu_kernels = 'dpbf16' but this CPU has no AVX512-BF16"):
        resolve_kind("dpbf16", CPU)


@pytest.mark.parametrize("kernel", PAIR_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 65, 100])
def test_pair_kernels_bfloat16_out_is_the_float32_out_rounded_by_torch(kernel, rows):
    """A bfloat16 ``out`` gets each float32 sum (plus bias) rounded exactly as torch's
    conversion rounds it, on every path (dpbf16: M <= 8 and blocked; amx: the shared and the
    chunked ones, a partial block of 16 rows, from 64 rows two full panels stored together and a
    last odd one alone); a float32 ``out`` with ``bf16_values`` those rounded values widened back
    (``PackedLinear.logits``)."""
    op = PAIR_OPS[kernel]
    gen = torch.Generator().manual_seed(rows)
    n, k = 16 * 5 + 3, 96
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    panels = PackedLinear.pack(kernel, w).weight
    for b in (None, bias):
        wide = torch.empty(rows, n)
        op(wide, x, panels, b)
        narrow = torch.empty(rows, n, dtype=torch.bfloat16)
        op(narrow, x, panels, b)
        assert torch.equal(narrow.view(torch.int16), wide.to(torch.bfloat16).view(torch.int16))
        widened = torch.empty(rows, n)      # an LM head's logits: the rounded values in float32
        op(widened, x, panels, b, bf16_values=True)
        assert torch.equal(widened, wide.to(torch.bfloat16).float())
    packed = PackedLinear.pack(kernel, w)
    assert torch.equal(packed.logits(x), packed(x).float())


def test_layers_a_pair_kernel_cannot_take_fall_back_in_order():
    from tandem.models.cpu_linear import fitting_kind

    assert fitting_kind("amx", torch.bfloat16, 64) == "amx"
    assert fitting_kind("amx", torch.bfloat16, 48) == "dpbf16"  # K not whole tiles of 32
    assert fitting_kind("amx", torch.bfloat16, 47) == fitting_kind("dpbf16", torch.bfloat16, 47) == "tandem"
    assert fitting_kind("amx", torch.float32, 64) == "amx"  # split into bfloat16 parts on the tiles
    assert fitting_kind("amx", torch.float32, 48) == "tandem"
    assert fitting_kind("onednn", torch.float32, 47) == "onednn"


def test_amx_mode_without_the_instructions_is_refused(monkeypatch):
    from tandem.models import cpu_linear

    monkeypatch.setattr(cpu_linear, "amx_available", lambda: False)
    with pytest.raises(ValueError, match=r"cpu_kernels = 'amx' but this CPU \(or its operating system\) gives no AMX"):
        resolve_kind("amx", CPU)


@pytest.mark.skipif(amx_available() or not cpu_ops.load(), reason="runs where the amx kernel is built but cannot run")
def test_amx_kernel_refuses_a_cpu_without_amx():
    w = PackedLinear.pack("dpbf16", torch.zeros(16, 32, dtype=torch.bfloat16)).weight
    with pytest.raises(RuntimeError, match="no AMX-BF16"):
        cpu_ops.panel_linear_amx(torch.empty(1, 16), torch.zeros(1, 32, dtype=torch.bfloat16), w, None)


def _silu_pass(kind: str, x: torch.Tensor, panels: torch.Tensor, width: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], width, dtype=torch.bfloat16)
    getattr(cpu_ops, f"panel_linear_{kind}_silu")(out, x, panels)
    return out


@pytest.mark.parametrize("kind", PAIR_KERNELS)
@pytest.mark.parametrize(("width", "k"), [(48, 64), (64, 96), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 64, 65, 200, 300])
def test_silu_pass_equals_the_product_then_silu_and_mul(kind, width, k, rows):
    """``panel_linear_{dpbf16,amx}_silu`` on the panels of ``[gate; up]`` against the two passes
    it replaces (the kernel's product to a bfloat16 ``[M, 2 I]``, then ``silu_and_mul``): the
    same bits (both take vec_exp.h's SiLU; on AMX a last one is allowed, its tile sums and the
    plain product's being added in orders that may differ), and within bfloat16's rounding of
    float64 arithmetic on the same values. ``width`` 48: an odd number of gate panels (the last
    pair alone on AMX); rows on the few-row, shared (<= 64 or 96) and chunked paths, with partial
    tiles."""
    gen = torch.Generator().manual_seed(rows * 7 + width)
    w = (torch.randn(2 * width, k, generator=gen) / k**0.5).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    panels = PackedLinear.pack(kind, w).weight
    fused = _silu_pass(kind, x, panels, width)
    gate_up = torch.empty(rows, 2 * width, dtype=torch.bfloat16)
    getattr(cpu_ops, f"panel_linear_{kind}")(gate_up, x, panels, None)
    unfused = torch.empty(rows, width, dtype=torch.bfloat16)
    cpu_ops.silu_and_mul(unfused, gate_up)
    if kind == "dpbf16":
        assert torch.equal(fused, unfused)
    apart = (fused.view(torch.int16).int() - unfused.view(torch.int16).int()).abs()
    assert int(apart.max()) <= 1 and int((apart > 0).sum()) <= max(1, apart.numel() // 1000)
    product = x.double() @ w.double().T
    gate, up = product[:, :width], product[:, width:]
    torch.testing.assert_close(fused.double(), F.silu(gate) * up, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", PAIR_KERNELS)
def test_silu_pass_takes_strided_rows_and_any_thread_count_and_refuses_a_wrong_out(kind):
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(2 * 96, 64, generator=gen) / 8).bfloat16()
    panels = PackedLinear.pack(kind, w).weight
    for rows in (5, 90, 200):  # few rows, one row block, several
        x = torch.randn(rows, 192, generator=gen).bfloat16()[:, 64:128]  # rows 192 apart
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = _silu_pass(kind, x, panels, 96)
            torch.set_num_threads(max(2, threads))
            many = _silu_pass(kind, x, panels, 96)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one, many)
        assert torch.equal(many, _silu_pass(kind, x.contiguous(), panels, 96))
    with pytest.raises(RuntimeError, match=f"panel_linear_{kind}_silu"):
        _silu_pass(kind, x, panels, 95)
    with pytest.raises(RuntimeError, match=f"panel_linear_{kind}_silu"):
        getattr(cpu_ops, f"panel_linear_{kind}_silu")(torch.empty(rows, 96), x, panels)  # float32 out


@pytest.mark.parametrize("kind", PAIR_KERNELS)
def test_a_gated_mlp_takes_the_one_pass_where_it_applies(kind):
    """``GatedMLP`` with SiLU on a dpbf16- or amx-packed bfloat16 ``[gate; up]`` multiplies and
    applies SiLU-and-mul in one pass (``silu_pass`` names the kernel and the panels) and gives
    what its two passes give; a bias, another kernel or a float32 layer keep the two passes."""
    from tandem.models.layers import GatedMLP
    from tandem.quant.unquantized import UnquantizedLinearMethod

    gen = torch.Generator().manual_seed(11)
    gate, up = torch.randn(96, 64, generator=gen) / 8, torch.randn(96, 64, generator=gen) / 8
    down = torch.randn(64, 96, generator=gen) / 10

    def mlp_for(mode: str, dtype: torch.dtype = torch.bfloat16, bias: bool = False) -> GatedMLP:
        mlp = GatedMLP(64, 96, bias, "silu", UnquantizedLinearMethod())
        mlp.gate_up_proj.load("weight", gate, 0)
        mlp.gate_up_proj.load("weight", up, 1)
        mlp.down_proj.load("weight", down, 0)
        if bias:
            mlp.gate_up_proj.load("bias", torch.zeros(96), 0)
            mlp.gate_up_proj.load("bias", torch.zeros(96), 1)
            mlp.down_proj.load("bias", torch.zeros(64), 0)
        mlp = mlp.to(dtype)
        assert mlp.use_cpu_kernels()
        pack_cpu_linears(mlp, mode, torch.device("cpu"))
        return mlp

    x = torch.randn(7, 64, generator=gen).bfloat16()
    mlp = mlp_for(kind)
    one_pass = silu_pass(mlp.gate_up_proj, 7)
    assert one_pass is not None and one_pass[0] is getattr(cpu_ops, f"panel_linear_{kind}_silu")
    fused = mlp(x)
    act = torch.empty(7, 96, dtype=torch.bfloat16)
    cpu_ops.silu_and_mul(act, mlp.gate_up_proj(x))
    two_passes = mlp.down_proj(act)
    torch.testing.assert_close(fused.float(), two_passes.float(), atol=1e-2, rtol=1e-2)
    g, u = x.double() @ gate.bfloat16().double().T, x.double() @ up.bfloat16().double().T
    torch.testing.assert_close(fused.double(), (F.silu(g) * u) @ down.bfloat16().double().T, atol=3e-2, rtol=3e-2)
    assert silu_pass(mlp_for(kind, bias=True).gate_up_proj, 7) is None
    assert silu_pass(mlp_for("tandem").gate_up_proj, 7) is None
    assert silu_pass(mlp_for(kind, torch.float32).gate_up_proj, 7) is None
