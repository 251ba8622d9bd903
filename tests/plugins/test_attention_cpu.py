"""The cpu attention backend beyond the shared cases of test_attention_torch.py (which run it
against the naive reference): its kernel is really built here, it agrees with the torch
backend (the reference backend) on a decode batch of a real model's shape, and it keeps working
through the torch path when the kernel cannot be built."""
from __future__ import annotations

import pytest
import torch

from tandem.config import TandemConfig
from tandem.kernels import cpu_ops
from tandem.models import cpu_tuning
from tandem.plugins import attention_cpu
from tandem.plugins.attention_cpu import CpuAttentionBackend, choose_sdpa_rows
from tandem.plugins.attention_torch import TorchAttentionBackend
from tests.helpers.paged_batch import SeqSpec, build_metadata, scattered_tables

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16


def test_the_kernel_builds_on_this_machine():
    assert cpu_ops.load()


def decode_batch(dtype, seed, contexts, num_blocks=1200, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(dtype)
    tables = scattered_tables([c + 1 for c in contexts], BLOCK_SIZE, num_blocks, seed=seed)
    seqs = [SeqSpec(t, c, 1) for t, c in zip(tables, contexts)]
    q = torch.randn(len(seqs), heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(seqs), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(seqs), kv_heads, head_dim, generator=gen).to(dtype)
    return pool, seqs, q, k, v


def run(backend_cls, pool, seqs, q, k, v, window=None):
    md = build_metadata(seqs, BLOCK_SIZE)
    backend_cls.prepare_metadata(md)
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    backend = backend_cls(heads, kv_heads, head_dim, head_dim**-0.5, window)
    return backend.forward(q, k, v, pool[:, 0], md)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_batch_matches_the_torch_backend(dtype, atol, window):
    gen = torch.Generator().manual_seed(4)
    contexts = torch.randint(0, 300, (48,), generator=gen).tolist() + [0, 15, 16, 17]
    pool, seqs, q, k, v = decode_batch(dtype, 4, contexts)
    ours = run(CpuAttentionBackend, pool.clone(), seqs, q, k, v, window)
    ref_pool = pool.clone()
    ref = run(TorchAttentionBackend, ref_pool, seqs, q, k, v, window)
    torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 1, 128), (10, 2, 80), (4, 4, 48), (6, 3, 72), (10, 5, 36)])
def test_other_head_layouts_match_the_torch_backend(dtype, atol, heads, kv_heads, head_dim):
    """Query heads per KV head 8 (two passes of four), 5, 1 and 2; head sizes that take the
    16-wide path (128, 80, 48), the 8-wide one (72) and the plain loop (36); few rows (a row's KV
    heads split over the threads) and many."""
    for contexts in ([0, 37, 130], [5, 16, 17, 90, 250, 3, 64, 33, 1]):
        pool, seqs, q, k, v = decode_batch(dtype, 9, contexts, 200, heads, kv_heads, head_dim)
        ours = run(CpuAttentionBackend, pool.clone(), seqs, q, k, v)
        ref = run(TorchAttentionBackend, pool.clone(), seqs, q, k, v)
        torch.testing.assert_close(ours.float(), ref.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_uneven_rows_give_the_same_bits_on_one_thread_and_two(dtype, atol):
    # Rows are shared out over the threads (from one counter, or in contiguous shares whose
    # threads ask for their next row's blocks ahead, then take from each other's ends); each row
    # is still computed by one thread, the same way.
    gen = torch.Generator().manual_seed(6)
    contexts = [600, 1, 2, 3] + torch.randint(0, 40, (20,), generator=gen).tolist() + [450]
    pool, seqs, q, k, v = decode_batch(dtype, 6, contexts)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(CpuAttentionBackend, pool.clone(), seqs, q, k, v)
        torch.set_num_threads(max(2, threads))
        many = run(CpuAttentionBackend, pool.clone(), seqs, q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    ref = run(TorchAttentionBackend, pool.clone(), seqs, q, k, v)
    torch.testing.assert_close(many.float(), ref.float(), atol=atol, rtol=atol)


def test_falls_back_to_the_torch_path_without_the_kernel(monkeypatch):
    pool, seqs, q, k, v = decode_batch(torch.float32, 5, [3, 40, 90])
    expected = run(CpuAttentionBackend, pool.clone(), seqs, q, k, v)
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    torch.testing.assert_close(run(CpuAttentionBackend, pool.clone(), seqs, q, k, v), expected,
                               atol=1e-5, rtol=1e-5)


def test_a_row_table_out_of_range_is_refused_before_any_read():
    pool, seqs, q, k, v = decode_batch(torch.float32, 7, [3, 40])
    kv = pool[:, 0]
    tables = torch.tensor([[1, 2, 3], [4, 5, 6]])
    rows, lens = torch.tensor([0, 1]), torch.tensor([3, 40])
    out = torch.zeros_like(q)
    with pytest.raises(RuntimeError, match=r"row_tables\[1\] = 2 names no row of tables \(2 rows\)"):
        cpu_ops.paged_decode(out, q, kv, rows, tables, lens, 0.125, 0, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="one table row per query row"):
        cpu_ops.paged_decode(out, q, kv, rows, tables[:1], lens, 0.125, 0)
    assert not out.any()


@pytest.mark.parametrize(("paged", "sdpa", "expected"), [
    ([1, 2, 4, 8, 16], [2, 2.5, 3, 4, 5], 256),       # SDPA ahead from 256 rows on
    ([1, 2, 4, 8, 16], [0.5, 1, 2, 4, 8], 64),        # everywhere
    ([1, 2, 4, 8, 16], [2, 4, 8, 16, 32], None),      # nowhere
    ([1, 2, 4, 8, 16], [0.5, 4, 2, 4, 8], 256),       # a win below a loss does not count
    ([1, 2, 4, 8, 16], [2, 4, 8, 16, 15], None),      # ahead at 1024 by less than SWITCH_GAIN
])
def test_sdpa_takes_over_from_the_fewest_rows_it_wins_at_and_above(paged, sdpa, expected):
    assert choose_sdpa_rows(paged, sdpa) == expected


def test_only_sequences_of_sdpa_rows_or_more_go_to_sdpa():
    backend = type("Cut", (CpuAttentionBackend,), {"sdpa_rows": 256})
    tables = scattered_tables([301, 101, 256, 40], BLOCK_SIZE, 200, seed=2)
    md = build_metadata([SeqSpec(tables[0], 0, 300), SeqSpec(tables[1], 0, 100), SeqSpec(tables[2], 0, 256),
                         SeqSpec(tables[3], 39, 1)], BLOCK_SIZE)
    backend.prepare_metadata(md)
    plan = md.extra["torch_attention_plan"]
    assert [(p.start, p.end) for p in plan.prefills] == [(0, 300), (400, 656)]
    assert plan.decode.rows.tolist() == list(range(300, 400)) + [656]
    # the 100 rows of the second sequence share its one table
    assert plan.decode.tables.shape[0] == 4 and plan.decode.row_tables.tolist() == [1] * 100 + [3]


def config(mode):
    return TandemConfig.model_validate({"engine": {"cpu_prefill_attention": mode}})


@pytest.mark.parametrize(("mode", "rows"), [("paged", None), ("sdpa", 9)])
def test_forced_modes(mode, rows):
    assert CpuAttentionBackend.for_model(config(mode), torch.float32, 4, 2, 64).sdpa_rows == rows


def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_tuning, "machine_is_busy", lambda: None)
    monkeypatch.setattr(cpu_tuning.CpuMeter, "others_share", lambda self: 0.0)
    calls = []

    def measured(*shape_and_timer):
        calls.append(shape_and_timer[:4])
        assert shape_and_timer[4] is cpu_tuning.ChoiceCache.measure
        return {"paged": [1, 2, 4, 8, 16], "sdpa": [2, 2.5, 3, 4, 5]}

    monkeypatch.setattr(attention_cpu, "measure", measured)
    tuning = cpu_tuning.ChoiceCache("attention")
    first = CpuAttentionBackend.for_model(config("auto"), torch.bfloat16, 9, 3, 64, tuning)
    second = CpuAttentionBackend.for_model(config("auto"), torch.bfloat16, 9, 3, 64, tuning)
    other = CpuAttentionBackend.for_model(config("auto"), torch.float32, 9, 3, 64, tuning)
    assert (first.sdpa_rows, second.sdpa_rows, other.sdpa_rows) == (256, 256, 256)
    assert calls == [(torch.bfloat16, 9, 3, 64), (torch.float32, 9, 3, 64)]
    assert issubclass(first, CpuAttentionBackend) and first.name == "cpu"


def test_a_busy_machine_gets_the_fixed_rule_and_nothing_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_tuning, "machine_is_busy", lambda: 0.6)
    monkeypatch.setattr(attention_cpu, "measure", lambda *shape: pytest.fail("measured on a busy machine"))
    tuning = cpu_tuning.ChoiceCache("attention")
    chosen = CpuAttentionBackend.for_model(config("auto"), torch.bfloat16, 9, 3, 64, tuning)
    assert chosen.sdpa_rows == attention_cpu.FIXED_SDPA_ROWS
    assert not list(tmp_path.rglob("attention-*.json"))
    # without a tuning (a backend built outside a worker) the fixed rule too, nothing measured
    assert CpuAttentionBackend.for_model(config("auto"), torch.bfloat16, 9, 3, 64).sdpa_rows == \
        attention_cpu.FIXED_SDPA_ROWS


def test_the_measurement_times_both_ways_at_every_row_count(monkeypatch):
    monkeypatch.setattr(attention_cpu, "PREFILL_ROWS", (16, 32))
    seconds = attention_cpu.measure(torch.float32, 4, 2, 32, cpu_tuning.measure)
    assert set(seconds) == {"paged", "sdpa"} and all(len(v) == 2 and min(v) > 0 for v in seconds.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_writes_land_where_the_torch_backends_do_from_any_layout(dtype):
    """The step's K and V go into the pool row by row (``cpu_ops.copy_rows``) exactly where the
    torch backend's ``index_copy_`` puts them: from slices of a qkv product (rows one run each)
    and from K and V whose rows are not one run (heads and head dims transposed)."""
    contexts = [0, 15, 16, 40, 200]
    pool, seqs, q, k, v = decode_batch(dtype, 9, contexts)
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(len(seqs), (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    sliced = [qkv[:, (HEADS + i * KV_HEADS) * HEAD_DIM:(HEADS + (i + 1) * KV_HEADS) * HEAD_DIM]
              .view(len(seqs), KV_HEADS, HEAD_DIM) for i in range(2)]
    transposed = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]
    for key, value in (sliced, transposed):
        md = build_metadata(seqs, BLOCK_SIZE)
        CpuAttentionBackend.prepare_metadata(md)
        ours, ref = pool.clone(), pool.clone()
        CpuAttentionBackend._write(key, value, ours[:, 0], md.extra["torch_attention_plan"])
        TorchAttentionBackend._write(key, value, ref[:, 0], md.extra["torch_attention_plan"])
        assert torch.equal(ours, ref) and not torch.equal(ours, pool)
