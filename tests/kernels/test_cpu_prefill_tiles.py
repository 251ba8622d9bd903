"""paged_decode's prompt rows as tile products (kernels/cpu/prefill_tiles.cpp), on AMX tiles and
in vdpbf16ps, each where this CPU has it, against float64 attention over the same bfloat16
inputs, and against the row kernel (the same call one row at a time, which leaves no run to
take): runs of 8-16 rows of one sequence, their leftovers, context before the chunk, decode rows
in the same call, head sizes 64-256 and 1-8 query heads per KV head, garbage in the pool past a
sequence's end, one thread or two, and a window (taken only where no row reaches past it)."""
from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels import cpu_ops
from tandem.models.cpu_linear import amx_available, dpbf16_available

BS = 16


@pytest.fixture(params=["amx", "dpbf16"])
def tiles(request):
    """Each kind of tile product in turn, where this CPU has it."""
    if request.param == "amx" and not amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16 instructions")
    if request.param == "dpbf16" and not dpbf16_available():
        pytest.skip("this CPU has no AVX512-BF16")
    before = cpu_ops.use_prefill_amx(request.param == "amx")
    yield request.param
    cpu_ops.use_prefill_amx(before)


def step(heads, kv_heads, d, seqs, seed=0, num_blocks=96):
    """One call's inputs: ``seqs`` = [(context, rows)]: each sequence's rows see context + 1 ..
    context + rows keys (a prompt chunk, or a decode row when rows is 1); blocks scattered."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 2, BS, kv_heads, d, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(c + r) // BS) for c, r in seqs)
    tables, row_tables, lens = [], [], []
    for s, (context, rows) in enumerate(seqs):
        count = -(-(context + rows) // BS)
        tables.append(perm[:count] + [0] * (width - count))
        perm = perm[count:]
        row_tables += [s] * rows
        lens += list(range(context + 1, context + rows + 1))
    n = len(lens)
    q = torch.randn(n, heads, d, generator=gen).to(torch.bfloat16)
    return (q, pool, torch.arange(n), torch.tensor(tables), torch.tensor(lens), torch.tensor(row_tables))


def attend(q, pool, rows, tables, lens, row_tables, window=0):
    out = torch.empty_like(q)
    cpu_ops.paged_decode(out, q, pool, rows, tables, lens, q.shape[2] ** -0.5, window, row_tables)
    return out


def row_by_row(q, pool, rows, tables, lens, row_tables, window=0):
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        cpu_ops.paged_decode(out[i:i + 1], q[i:i + 1], pool, rows[:1], tables, lens[i:i + 1], q.shape[2] ** -0.5,
                             window, row_tables[i:i + 1])
    return out


def float64_attention(q, pool, rows, tables, lens, row_tables):
    heads, kv_heads, d = q.shape[1], pool.shape[3], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        n = int(lens[i])
        blocks = tables[row_tables[i]][: -(-n // BS)]
        k = pool[blocks, 0].reshape(-1, kv_heads, d)[:n].double()
        v = pool[blocks, 1].reshape(-1, kv_heads, d)[:n].double()
        for h in range(heads):
            p = torch.softmax(k[:, h * kv_heads // heads] @ q[rows[i], h].double() / math.sqrt(d), 0)
            out[rows[i], h] = p @ v[:, h * kv_heads // heads]
    return out


LAYOUTS = [(9, 3, 64), (8, 1, 128), (4, 1, 256), (8, 8, 64), (16, 4, 128)]
STEPS = [
    [(0, 37)],                         # runs of 16, 16 and 5 left over
    [(50, 20), (0, 8), (3, 7)],        # context before a chunk; a run of exactly 8; 7: all left over
    [(120, 1), (0, 16), (30, 1), (16, 33)],  # decode rows between prompt chunks
]


@pytest.mark.parametrize(("heads", "kv_heads", "d"), LAYOUTS)
@pytest.mark.parametrize("seqs", STEPS)
def test_prompt_rows_on_tiles_match_float64_attention(tiles, heads, kv_heads, d, seqs):
    inputs = step(heads, kv_heads, d, seqs, seed=len(seqs) * d + heads)
    want = float64_attention(*inputs)
    got = attend(*inputs)
    rows = row_by_row(*inputs)
    # bfloat16 outputs: both within its rounding of the float64 result (values of size ~1)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(rows.double(), want, atol=2e-2, rtol=1e-2)
    # and no further from it than the row kernel by more than a rounding step or so
    assert (got.double() - want).abs().mean() <= 1.5 * (rows.double() - want).abs().mean() + 1e-4
    if any(r >= 8 for _, r in seqs):  # the tiles ran (they round P to bfloat16: other bits)
        assert not torch.equal(got, rows)


def test_garbage_past_a_sequences_end_never_reaches_a_sum(tiles):
    """Slots of a sequence's last block past its length hold NaN and
    infinities: the tiles read keys only up to the last row's length and zero the values past
    it, so the output is the same as with zeros there."""
    q, pool, rows, tables, lens, row_tables = step(9, 3, 64, [(0, 21), (5, 30)], seed=3)
    clean = attend(q, pool.clone(), rows, tables, lens, row_tables)
    dirty = pool.clone()
    for s, last_len in ((0, 21), (1, 35)):
        block = tables[s][(last_len - 1) // BS]
        dirty[block, :, last_len % BS or BS:] = float("nan")
        dirty[block, 1, -1] = float("inf")
    got = attend(q, dirty, rows, tables, lens, row_tables)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, clean)


def test_one_thread_and_two_give_the_same_bits(tiles):
    inputs = step(9, 3, 64, [(0, 64), (10, 40), (3, 1)], seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(*inputs)
        torch.set_num_threads(max(2, threads))
        many = attend(*inputs)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_a_window_no_row_reaches_past_changes_nothing(tiles):
    """A sliding layer's window longer than every row's context (a short prompt): the tiles take
    the runs as without a window, bit for bit."""
    inputs = step(4, 1, 256, [(0, 40), (10, 21)], seed=7)
    assert torch.equal(attend(*inputs, window=61), attend(*inputs))


def test_a_window_keeps_the_row_kernel(tiles):
    inputs = step(9, 3, 64, [(40, 24)], seed=6)
    assert torch.equal(attend(*inputs, window=20), row_by_row(*inputs, window=20))


@pytest.mark.skipif(not amx_available(), reason="needs both kinds: AMX-BF16 and AVX512-BF16")
def test_amx_and_dpbf16_tiles_agree():
    """The same tile products by either instruction: the sums differ only in their order."""
    inputs = step(16, 4, 128, [(20, 40), (0, 16)], seed=8)
    before = cpu_ops.use_prefill_amx(True)
    try:
        amx = attend(*inputs)
        cpu_ops.use_prefill_amx(False)
        dp = attend(*inputs)
    finally:
        cpu_ops.use_prefill_amx(before)
    torch.testing.assert_close(dp.float(), amx.float(), atol=1e-2, rtol=1e-2)
