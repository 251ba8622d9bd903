"""The cpu attention backend beyond the shared cases of test_attention_torch.py (which run it
against the naive reference): its kernel is really built here, it agrees with the torch
backend (the reference backend) on a decode batch of a real model's shape, and it keeps working
through the torch path when the kernel cannot be built."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_ops
from tandem.plugins.attention_cpu import CpuAttentionBackend
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


def test_uneven_rows_give_the_same_bits_on_one_thread_and_two():
    # Rows are taken one at a time from a shared counter (a long row does not hold up the rows
    # after it on the same thread); each row is still computed by one thread, the same way.
    gen = torch.Generator().manual_seed(6)
    contexts = [600, 1, 2, 3] + torch.randint(0, 40, (20,), generator=gen).tolist() + [450]
    pool, seqs, q, k, v = decode_batch(torch.float32, 6, contexts)
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
    torch.testing.assert_close(many, ref, atol=1e-5, rtol=1e-5)


def test_falls_back_to_the_torch_path_without_the_kernel(monkeypatch):
    pool, seqs, q, k, v = decode_batch(torch.float32, 5, [3, 40, 90])
    expected = run(CpuAttentionBackend, pool.clone(), seqs, q, k, v)
    monkeypatch.setattr(cpu_ops, "load", lambda: False)
    torch.testing.assert_close(run(CpuAttentionBackend, pool.clone(), seqs, q, k, v), expected,
                               atol=1e-5, rtol=1e-5)
