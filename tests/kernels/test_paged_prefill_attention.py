"""paged_prefill_attention against its torch reference, and the reference against torch's
scaled_dot_product_attention over contiguous K/V with hand-built causal/window masks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.paged_prefill_attention import paged_attention_reference, paged_prefill_attention

from .paged_inputs import poison_unused, random_cache, scattered_block_tables, tolerances

NUM_BLOCKS = 64
# (cached prefix, new tokens): a 1-token prompt, exactly one block, a prompt that is not a
# multiple of the block size, a cached prefix with a new chunk, a single token after a prefix.
MIXED_BATCH = [(0, 1), (0, 16), (0, 37), (32, 13), (16, 1)]


class Batch:
    """A flattened batch of chunks over a random paged cache (NaN outside the sequences'
    positions), with a NaN-poisoned output that has two extra rows belonging to no sequence."""

    def __init__(self, chunks, num_heads, num_kv_heads, head_dim, dtype, device, gen, block_size=16):
        self.seq_lens_list = [c + n for c, n in chunks]
        self.query_lens = [n for _, n in chunks]
        self.cache = random_cache(NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype, device, gen)
        self.block_tables = scattered_block_tables(self.seq_lens_list, block_size, NUM_BLOCKS, gen, device)
        poison_unused(self.cache, self.block_tables, self.seq_lens_list)
        starts = torch.tensor([0, *self.query_lens]).cumsum(0)
        self.query_start_loc = starts.to(device=device, dtype=torch.int32)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)
        num_tokens = sum(self.query_lens)
        self.query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
        self.query = self.query.to(device=device, dtype=dtype)
        self.out = torch.full((num_tokens + 2, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
        self.scale = head_dim ** -0.5

    def run(self, sliding_window=None):
        paged_prefill_attention(self.query, self.cache, self.block_tables, self.query_start_loc,
                                self.seq_lens, max(self.query_lens), self.scale, sliding_window,
                                out=self.out[: self.query.shape[0]])
        return self.out

    def reference(self, sliding_window=None):
        return paged_attention_reference(self.query, self.cache, self.block_tables, self.query_start_loc,
                                         self.seq_lens, self.scale, sliding_window)


def _check(batch, sliding_window=None):
    out = batch.run(sliding_window)
    num_tokens = batch.query.shape[0]
    torch.testing.assert_close(out[:num_tokens], batch.reference(sliding_window), **tolerances(out.dtype))
    assert out[num_tokens:].isnan().all(), "rows past the batch must stay untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch_matches_reference(dtype, gqa, head_dim, device, gen):
    num_kv_heads = 1 if gqa == 8 else 2
    _check(Batch(MIXED_BATCH, num_kv_heads * gqa, num_kv_heads, head_dim, dtype, device, gen))


def test_bfloat16_converts_to_float32(device, gen):
    _check(Batch(MIXED_BATCH, 8, 2, 64, torch.bfloat16, device, gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [1, 8, 20])
def test_sliding_window(dtype, window, device, gen):
    _check(Batch([(0, 37), (40, 9), (5, 1)], 4, 2, 64, dtype, device, gen), sliding_window=window)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size, device, gen):
    _check(Batch([(0, 9), (20, 14)], 4, 2, 64, torch.float32, device, gen, block_size=block_size))


def test_long_chunk_spans_several_query_tiles(device, gen):
    _check(Batch([(3, 150), (0, 70)], 2, 1, 64, torch.float16, device, gen))


def test_head_dim_not_a_power_of_two(device, gen):
    _check(Batch([(0, 20), (17, 3)], 4, 2, 96, torch.float32, device, gen))


@pytest.mark.parametrize("window", [None, 6])
def test_reference_matches_sdpa(window, gen):
    """The reference's gather-through-the-block-table and masks against SDPA on the contiguous
    K/V that were scattered into the cache."""
    block_size, kv_heads, heads, dim = 4, 2, 4, 16
    chunks = [(0, 5), (9, 3)]
    seq_lens = [c + n for c, n in chunks]
    cache = torch.full((NUM_BLOCKS, 2, block_size, kv_heads, dim), float("nan"), dtype=torch.float64)
    tables = scattered_block_tables(seq_lens, block_size, NUM_BLOCKS, gen, torch.device("cpu"))
    keys, values, expected = [], [], []
    query = torch.randn(sum(n for _, n in chunks), heads, dim, generator=gen, dtype=torch.float64)
    row = 0
    for i, ((context, n), seq_len) in enumerate(zip(chunks, seq_lens)):
        k = torch.randn(seq_len, kv_heads, dim, generator=gen, dtype=torch.float64)
        v = torch.randn(seq_len, kv_heads, dim, generator=gen, dtype=torch.float64)
        for p in range(seq_len):
            block = int(tables[i, p // block_size])
            cache[block, 0, p % block_size] = k[p]
            cache[block, 1, p % block_size] = v[p]
        q_pos = torch.arange(context, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        q = query[row:row + n].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k.transpose(0, 1).repeat_interleave(2, 0),
                                             v.transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask)
        expected.append(out.transpose(0, 1))
        row += n
    query_start_loc = torch.tensor([0, 5, 8])
    got = paged_attention_reference(query, cache, tables, query_start_loc, torch.tensor(seq_lens),
                                    dim ** -0.5, window)
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)  # reference: float32


def test_rejects_bad_arguments(device, gen):
    batch = Batch([(0, 4)], 4, 2, 64, torch.float16, device, gen)
    with pytest.raises(ValueError, match="query has dtype"):
        paged_prefill_attention(batch.query.float(), batch.cache, batch.block_tables, batch.query_start_loc,
                                batch.seq_lens, 4, batch.scale)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_prefill_attention(batch.query[:, :3], batch.cache, batch.block_tables, batch.query_start_loc,
                                batch.seq_lens, 4, batch.scale)
    with pytest.raises(ValueError, match="query_start_loc has shape"):
        paged_prefill_attention(batch.query, batch.cache, batch.block_tables, batch.query_start_loc[:1],
                                batch.seq_lens, 4, batch.scale)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-without-interpreter error")
def test_cpu_tensors_need_the_interpreter(monkeypatch, gen):
    batch = Batch([(0, 4)], 4, 2, 64, torch.float32, torch.device("cpu"), gen)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        batch.run()
