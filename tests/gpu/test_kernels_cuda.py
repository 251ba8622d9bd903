"""The Triton kernels compiled for a real GPU, in bfloat16 at model-sized shapes, against their
torch references; the "triton" backend against the "torch" backend on CUDA; and a decode step
captured in a CUDA graph replayed over other sequence lengths."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.paged_inputs import poison_unused, random_cache, scattered_block_tables

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16 = dict(atol=2e-2, rtol=2e-2)  # one bf16 ulp around 1.0 is 0.0078


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(99)


def _randn(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(device=CUDA, dtype=dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_long_contexts(num_splits, gen):
    from tandem.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference

    seq_lens = [1, 17, 1000, 4096, 2500, 16, 333, 4000]
    cache = random_cache(1600, 16, 8, 128, torch.bfloat16, CUDA, gen)
    tables = scattered_block_tables(seq_lens, 16, 1600, gen, CUDA)
    poison_unused(cache, tables, seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    q = _randn(len(seq_lens), 32, 128, gen=gen)
    out = paged_decode_attention(q, cache, tables, lens, 128 ** -0.5, num_splits=num_splits)
    expected = paged_decode_attention_reference(q, cache, tables, lens, 128 ** -0.5)
    torch.testing.assert_close(out, expected, **BF16)


@pytest.mark.parametrize("window", [None, 256])
def test_prefill_long_chunks(window, gen):
    from tandem.kernels.paged_prefill_attention import paged_attention_reference, paged_prefill_attention

    chunks = [(0, 1000), (512, 300), (100, 1), (0, 17)]
    seq_lens = [c + n for c, n in chunks]
    cache = random_cache(200, 16, 8, 64, torch.bfloat16, CUDA, gen)
    tables = scattered_block_tables(seq_lens, 16, 200, gen, CUDA)
    poison_unused(cache, tables, seq_lens)
    starts = torch.tensor([0, *(n for _, n in chunks)]).cumsum(0).to(device=CUDA, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=CUDA)
    q = _randn(int(starts[-1]), 32, 64, gen=gen)
    out = paged_prefill_attention(q, cache, tables, starts, lens, 1000, 0.125, window)
    expected = paged_attention_reference(q, cache, tables, starts, lens, 0.125, window)
    torch.testing.assert_close(out, expected, **BF16)


def test_rmsnorm_bf16(gen):
    from tandem.kernels.fused_rmsnorm import rms_norm, rms_norm_reference

    x, residual = _randn(333, 4096, gen=gen), _randn(333, 4096, gen=gen)
    weight = _randn(4096, gen=gen)
    expected_residual = residual.clone()
    expected, _ = rms_norm_reference(x, weight, 1e-5, expected_residual)
    out, _ = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, expected, **BF16)


def test_kv_cache_write_bf16_is_exact(gen):
    from tandem.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference

    pool = torch.full((512, 4, 2, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device=CUDA)
    key, value = _randn(3000, 8, 128, gen=gen), _randn(3000, 8, 128, gen=gen)
    slots = torch.randperm(512 * 16, generator=gen)[:3000].to(CUDA)
    slots[::7] = -1
    expected = pool.clone()
    write_kv_cache_reference(key, value, expected[:, 2], slots)
    write_kv_cache(key, value, pool[:, 2], slots)
    torch.testing.assert_close(pool, expected, rtol=0, atol=0, equal_nan=True)


def _step(backend_cls, chunks, window, gen_seed, extra=None):
    from tests.helpers.paged_batch import SeqSpec, build_metadata, scattered_tables

    gen = torch.Generator().manual_seed(gen_seed)
    pool = _randn(600, 2, 2, 16, 8, 64, gen=gen)
    tables = scattered_tables([c + n for c, n in chunks], 16, 600, seed=gen_seed)
    md = build_metadata([SeqSpec(t, c, n) for t, (c, n) in zip(tables, chunks)], 16, device=CUDA)
    md.extra.update(extra or {})
    q = _randn(md.num_tokens, 32, 64, gen=gen)
    k, v = _randn(md.num_tokens, 8, 64, gen=gen), _randn(md.num_tokens, 8, 64, gen=gen)
    backend = backend_cls(32, 8, 64, scale=0.125, sliding_window=window)
    backend_cls.prepare_metadata(md)
    return backend.forward(q, k, v, pool[:, 1], md), pool


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("chunks", [
    [(0, 300), (256, 77), (1000, 1), (4000, 1), (0, 1)],
    [(1, 1), (500, 1), (3000, 1), (5000, 1)],
])
def test_triton_backend_matches_torch_backend(chunks, window):
    from tandem.plugins.attention_torch import TorchAttentionBackend
    from tandem.plugins.attention_triton import TritonAttentionBackend

    out, pool = _step(TritonAttentionBackend, chunks, window, 5)
    expected_out, expected_pool = _step(TorchAttentionBackend, chunks, window, 5)
    assert torch.equal(pool, expected_pool)
    torch.testing.assert_close(out, expected_out, **BF16)


def test_decode_replays_in_a_cuda_graph(gen):
    """Captured once with fixed buffers and a fixed split count, replayed for other lengths."""
    from tandem.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_reference

    batch, max_blocks = 16, 128
    cache = random_cache(batch * max_blocks + 1, 16, 8, 128, torch.bfloat16, CUDA, gen)
    tables = (torch.randperm(batch * max_blocks, generator=gen) + 1).view(batch, max_blocks)
    tables = tables.to(device=CUDA, dtype=torch.int32)
    q = _randn(batch, 32, 128, gen=gen)
    lens = torch.ones(batch, dtype=torch.int32, device=CUDA)
    out = torch.empty_like(q)

    def step():
        paged_decode_attention(q, cache, tables, lens, 128 ** -0.5, num_splits=8, out=out)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        lens.copy_(torch.randint(1, max_blocks * 16 + 1, (batch,), generator=gen))
        q.copy_(_randn(batch, 32, 128, gen=gen))
        graph.replay()
        expected = paged_decode_attention_reference(q, cache, tables, lens, 128 ** -0.5)
        torch.testing.assert_close(out, expected, **BF16)
