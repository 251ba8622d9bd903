"""paged_decode_attention (with and without the flash-decoding split) against its torch
reference; the split heuristic on hand-computed cases."""
from __future__ import annotations

import pytest
import torch

from tandem.kernels.paged_decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)

from .paged_inputs import poison_unused, random_cache, scattered_block_tables, tolerances

NUM_BLOCKS = 48
# A context of 1 token, exactly one block, not a multiple of the block size, several tiles.
SEQ_LENS = [1, 16, 37, 150]


class Batch:
    """One query token per sequence over a random paged cache (NaN outside the sequences'
    positions), with a NaN-poisoned output that has one extra row."""

    def __init__(self, seq_lens, num_heads, num_kv_heads, head_dim, dtype, device, gen, block_size=16):
        self.cache = random_cache(NUM_BLOCKS, block_size, num_kv_heads, head_dim, dtype, device, gen)
        self.block_tables = scattered_block_tables(seq_lens, block_size, NUM_BLOCKS, gen, device)
        poison_unused(self.cache, self.block_tables, seq_lens)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        num_seqs = len(seq_lens)
        self.query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
        self.out = torch.full((num_seqs + 1, num_heads, head_dim), float("nan"), dtype=dtype, device=device)
        self.scale = head_dim ** -0.5

    def check(self, num_splits=None, sliding_window=None):
        rows = self.query.shape[0]
        paged_decode_attention(self.query, self.cache, self.block_tables, self.seq_lens, self.scale,
                               sliding_window, num_splits=num_splits, out=self.out[:rows])
        expected = paged_decode_attention_reference(self.query, self.cache, self.block_tables,
                                                    self.seq_lens, self.scale, sliding_window)
        torch.testing.assert_close(self.out[:rows], expected, **tolerances(self.query.dtype))
        assert self.out[rows:].isnan().all(), "rows past the batch must stay untouched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_reference(dtype, gqa, head_dim, num_splits, device, gen):
    num_kv_heads = 1 if gqa == 8 else 2
    Batch(SEQ_LENS, num_kv_heads * gqa, num_kv_heads, head_dim, dtype, device, gen).check(num_splits)


def test_bfloat16_converts_to_float32(device, gen):
    Batch(SEQ_LENS, 8, 2, 64, torch.bfloat16, device, gen).check(num_splits=2)


def test_more_splits_than_tiles(device, gen):
    """Most splits of short contexts are empty; the merge must ignore them."""
    Batch([1, 5, 70], 4, 2, 64, torch.float32, device, gen).check(num_splits=8)


def test_default_split_count(device, gen):
    Batch([3, 200], 4, 1, 64, torch.float16, device, gen).check()


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 16, 50])
def test_sliding_window(num_splits, window, device, gen):
    Batch([1, 16, 37, 150], 4, 2, 64, torch.float32, device, gen).check(num_splits, sliding_window=window)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size, device, gen):
    Batch([9, 30], 4, 2, 64, torch.float16, device, gen, block_size=block_size).check(num_splits=2)


def test_head_dim_not_a_power_of_two(device, gen):
    Batch([9, 40], 4, 2, 96, torch.float32, device, gen).check(num_splits=2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_sequence_gives_zeros(num_splits, device, gen):
    """A padding row of a captured graph has seq_len 0: zeros, not NaN."""
    batch = Batch([0, 20], 4, 2, 64, torch.float32, device, gen)
    batch.check(num_splits)
    assert torch.equal(batch.out[0], torch.zeros_like(batch.out[0]))


@pytest.mark.parametrize("num_seqs,num_kv_heads,max_seq_len,num_sms,expected", [
    (64, 8, 4096, 132, 1),       # 512 programs already fill 132 multiprocessors
    (16, 8, 128, 132, 1),        # 128 programs, but the contexts are too short to split
    (1, 8, 4096, 132, 16),       # ceil(1056 / 8) = 132 splits wanted, 4096 / 256 = 16 allowed
    (8, 8, 16384, 132, 17),      # ceil(1056 / 64) = 17
    (1, 1, 10**6, 132, MAX_SPLITS),
])
def test_choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, expected):
    assert choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms) == expected


def test_rejects_bad_arguments(device, gen):
    batch = Batch([4, 9], 4, 2, 64, torch.float16, device, gen)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(batch.query, batch.cache, batch.block_tables, batch.seq_lens, 1.0,
                               num_splits=MAX_SPLITS + 1)
    with pytest.raises(ValueError, match="seq_lens has shape"):
        paged_decode_attention(batch.query, batch.cache, batch.block_tables[:1], batch.seq_lens[:1], 1.0)
    with pytest.raises(ValueError, match="kv_cache must be"):
        paged_decode_attention(batch.query, batch.cache[:, 0], batch.block_tables, batch.seq_lens, 1.0)
