"""The kernels' work shared out over tandem's helper threads (work_queue.h's WorkPool) and over
OpenMP's: the same values as torch's reference either way, on two threads, also when two Python
threads call kernels at once (the second runs its work itself)."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import cpu_ops
from tandem.models.cpu_linear import PackedLinear
from tests.models.test_cpu_linear import needs_dpbf16


@pytest.fixture(params=[True, False], ids=["work_pool", "openmp"])
def pool(request):
    assert cpu_ops.load()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    previous = cpu_ops.use_work_pool(request.param)
    yield request.param
    cpu_ops.use_work_pool(previous)
    torch.set_num_threads(threads)


def linear_case(seed, m=5, n=1000, k=96):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)


def test_panel_linear_matches_torch_on_either_pool(pool):
    x, w = linear_case(0)
    torch.testing.assert_close(PackedLinear.pack("tandem", w)(x), F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_calls_from_two_python_threads_at_once(pool):
    cases = [linear_case(seed) for seed in range(4)]
    packed = [PackedLinear.pack("tandem", w) for _, w in cases]
    errors = []

    def call(i):
        x, w = cases[i]
        for _ in range(50):
            if not torch.allclose(packed[i](x), F.linear(x, w), atol=1e-4, rtol=1e-4):
                errors.append(i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@needs_dpbf16
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_shares_of_a_few_rows_product_cover_every_panel_once(pool, threads):
    """dpbf16 at up to 8 rows gives each thread a contiguous share of the panels and lets the
    first done take the others' from their back (work_queue.h's for_each_share): more threads
    than cores, so helpers start late and shares are taken from both ends, over panel counts
    that do not split evenly; every output equals a float64 reference each time."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(threads)
    for n in (16, 16 * 37 + 5, 16 * 200):
        w = (torch.randn(n, 64, generator=gen) / 8).bfloat16()
        packed = PackedLinear.pack("dpbf16", w)
        for m in (1, 3, 8):
            x = torch.randn(m, 64, generator=gen).bfloat16()
            want = (x.double() @ w.double().t()).bfloat16()
            for _ in range(30):
                torch.testing.assert_close(packed(x), want, atol=2e-2, rtol=2e-2)
