"""The torch attention backend and the cpu one (its decode rows in a C++ kernel; its long
sequences on the kernel or through SDPA) against a naive
reference: per sequence, contiguous K/V, one query row at a time, GQA by repeat_interleave,
causal and sliding-window masks written out by hand. Every test runs with both backends."""
from __future__ import annotations

import pytest
import torch

from tandem.plugins.attention_cpu import CpuAttentionBackend
from tandem.plugins.attention_torch import TorchAttentionBackend
from tests.helpers.paged_batch import SeqSpec, build_metadata, scattered_tables, slot_of

NUM_BLOCKS = 48
NUM_LAYERS = 2
LAYER = 1
# cpu-sdpa: the cpu backend with a sequence of 9 or more query rows in a step on torch's SDPA
# (engine.cpu_prefill_attention = "sdpa"), fewer on the kernel
BACKENDS = {"torch": TorchAttentionBackend, "cpu": CpuAttentionBackend,
            "cpu-sdpa": type("CpuSdpa", (CpuAttentionBackend,), {"sdpa_rows": 9})}


@pytest.fixture(params=list(BACKENDS), autouse=True)
def backend_cls(request, monkeypatch):
    """Every test of this file runs once per backend (Case.run reads it)."""
    monkeypatch.setattr(Case, "backend_cls", BACKENDS[request.param])
    return BACKENDS[request.param]


def reference_attention(q, k, v, context_len, scale, window=None):
    """q [Tq, H, D] at positions context_len.., k/v [S, Hkv, D] for positions 0..S-1."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).double()
    v = v.repeat_interleave(groups, dim=1).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        p = context_len + t
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,shd->hs", q[t].double(), k[lo : p + 1]) * scale
        out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[lo : p + 1])
    return out


class Case:
    """A paged pool filled with noise, sequences with known full K/V whose prefixes are already
    cached, and the new tokens' q/k/v in flattened batch order."""

    backend_cls: type = TorchAttentionBackend

    def __init__(self, context_and_query, *, heads=4, kv_heads=2, head_dim=16, block_size=4, seed=0,
                 dtype=torch.float32, num_padding_tokens=0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim, self.block_size = heads, kv_heads, head_dim, block_size
        self.pool = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        lengths = [c + n for c, n in context_and_query]
        tables = scattered_tables(lengths, block_size, NUM_BLOCKS, seed=seed)
        self.seqs = [SeqSpec(t, c, n) for t, (c, n) in zip(tables, context_and_query)]
        self.full_k = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
        self.full_v = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in lengths]
        self.q = [torch.randn(s.query_len, heads, head_dim, generator=gen) for s in self.seqs]
        for s, k, v in zip(self.seqs, self.full_k, self.full_v):
            self.write_cached(s, k, v, range(s.context_len))
        self.num_padding_tokens = num_padding_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.pool = self.pool.to(self.device)

    def write_cached(self, seq, k, v, positions):
        for p in positions:
            slot = slot_of(seq.block_table, p, self.block_size)
            blk, off = divmod(slot, self.block_size)
            self.pool[blk, LAYER, 0, off] = k[p].to(self.pool.dtype)
            self.pool[blk, LAYER, 1, off] = v[p].to(self.pool.dtype)

    def inputs(self):
        pad = self.num_padding_tokens
        q = torch.cat([*self.q, torch.randn(pad, self.heads, self.head_dim)])
        k = torch.cat([*(k[s.context_len :] for s, k in zip(self.seqs, self.full_k)),
                       torch.randn(pad, self.kv_heads, self.head_dim)])
        v = torch.cat([*(v[s.context_len :] for s, v in zip(self.seqs, self.full_v)),
                       torch.randn(pad, self.kv_heads, self.head_dim)])
        return (t.to(self.device, self.dtype) for t in (q, k, v))

    def run(self, window=None, prepare=True):
        backend = self.backend_cls(self.heads, self.kv_heads, self.head_dim, self.head_dim**-0.5, window)
        md = build_metadata(self.seqs, self.block_size, num_padding_tokens=self.num_padding_tokens,
                            device=self.device)
        if prepare:
            self.backend_cls.prepare_metadata(md)
        q, k, v = self.inputs()
        return backend.forward(q, k, v, self.pool[:, LAYER], md)

    def expected(self, window=None):
        outs = [reference_attention(q, k, v, s.context_len, self.head_dim**-0.5, window)
                for s, q, k, v in zip(self.seqs, self.q, self.full_k, self.full_v)]
        return torch.cat(outs)


def check(case, window=None, atol=1e-5, prepare=True):
    before = case.pool.clone()
    out = case.run(window, prepare)
    num_real = sum(s.query_len for s in case.seqs)
    torch.testing.assert_close(out[:num_real].cpu().double(), case.expected(window), atol=atol, rtol=atol)
    expected_pool = before.clone()
    for s, k, v in zip(case.seqs, case.full_k, case.full_v):
        for p in range(s.context_len, s.seq_len):
            blk, off = divmod(slot_of(s.block_table, p, case.block_size), case.block_size)
            expected_pool[blk, LAYER, 0, off] = k[p].to(case.pool.dtype)
            expected_pool[blk, LAYER, 1, off] = v[p].to(case.pool.dtype)
    assert torch.equal(case.pool, expected_pool), "the pool differs outside the new tokens' slots"
    return out


def test_single_prefill():
    check(Case([(0, 11)]))


def test_prefill_over_cached_prefix():
    check(Case([(9, 6)]))


@pytest.mark.parametrize("window", [None, 5])
def test_a_prefill_whose_mask_passes_the_bound_goes_in_pieces(monkeypatch, window):
    """MAX_MASK_BYTES so small that each piece is a few query rows: the same values."""
    import tandem.plugins.attention_torch as attention_torch

    monkeypatch.setattr(attention_torch, "MAX_MASK_BYTES", 3 * 26 * 4)
    check(Case([(9, 17), (0, 12), (3, 1)], seed=4), window)


def test_chunked_prefill_carries_the_cache_between_steps():
    chunks = (5, 4, 11)
    case = Case([(0, sum(chunks))], seed=3)
    table, full_k, full_v = case.seqs[0].block_table, case.full_k[0], case.full_v[0]
    gen = torch.Generator().manual_seed(9)
    start = 0
    for n in chunks:
        case.seqs = [SeqSpec(table, start, n)]
        case.full_k, case.full_v = [full_k[: start + n]], [full_v[: start + n]]
        case.q = [torch.randn(n, case.heads, case.head_dim, generator=gen)]
        check(case)
        start += n


def test_decode_batch_with_different_context_lengths():
    check(Case([(0, 1), (4, 1), (16, 1), (39, 1), (7, 1)]))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_ratios_and_head_dims(heads, kv_heads, head_dim):
    check(Case([(0, 7), (13, 1), (5, 4), (22, 1)], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
               block_size=8, seed=1))


def test_mixed_batch_with_decode_rows_between_prefill_rows():
    check(Case([(0, 6), (10, 1), (3, 5), (0, 1), (17, 1), (8, 9)], seed=2))


@pytest.mark.parametrize("window", [1, 5, 8])
def test_sliding_window(window):
    check(Case([(0, 13), (20, 1), (9, 7), (3, 1), (0, 1)], seed=5), window=window)


def test_padding_rows_with_slot_minus_one_write_nothing():
    check(Case([(4, 3), (9, 1)], num_padding_tokens=3, seed=6))


def test_metadata_is_prepared_on_first_use_when_the_runner_did_not():
    check(Case([(0, 5), (6, 1)], seed=7), prepare=False)


@pytest.mark.parametrize("dtype,atol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_half_precision(dtype, atol):
    check(Case([(0, 9), (12, 1), (5, 3)], dtype=dtype, seed=8), atol=atol)


def test_block_size_sixteen_with_long_contexts():
    check(Case([(0, 40), (70, 1), (33, 20), (100, 1)], block_size=16, seed=10), window=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window", [None, 5])
def test_cuda(dtype, atol, window):
    check(Case([(0, 9), (12, 1), (5, 3), (30, 1), (0, 1)], heads=8, kv_heads=2, head_dim=64, dtype=dtype,
               seed=12, num_padding_tokens=2, device="cuda"), window=window, atol=atol)
