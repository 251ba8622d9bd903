"""The "triton" attention backend: registered through the plugin hooks, importable without
loading triton, and giving the "torch" backend's outputs and KV writes on the same batches."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tandem.plugin_manager import get_registry
from tandem.plugins.attention_torch import TorchAttentionBackend
from tandem.plugins.attention_triton import TritonAttentionBackend
from tests.helpers.paged_batch import SeqSpec, build_metadata, scattered_tables

from .paged_inputs import tolerances

NUM_BLOCKS, NUM_LAYERS, LAYER, BLOCK_SIZE = 40, 2, 1, 16
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
# (cached prefix, new tokens): a new prompt, a cached prefix with a chunk, decodes.
MIXED = [(0, 7), (32, 5), (16, 1), (40, 1), (0, 16)]
DECODE_ONLY = [(0, 1), (16, 1), (36, 1), (99, 1)]


def test_registered_as_triton():
    assert get_registry().get("attention_backend", "triton") is TritonAttentionBackend


def test_import_does_not_load_triton():
    code = ("import sys, tandem.plugins.attention_triton; "
            "assert 'triton' not in sys.modules; "
            "assert 'tandem.kernels.paged_decode_attention' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def _run(backend_cls, chunks, dtype, device, window, num_padding_tokens=0, extra=None):
    """One layer step of ``backend_cls`` on a seeded pool and batch → (output, pool after)."""
    gen = torch.Generator().manual_seed(7)
    pool = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    pool = pool.to(device=device, dtype=dtype)
    tables = scattered_tables([c + n for c, n in chunks], BLOCK_SIZE, NUM_BLOCKS, seed=3)
    seqs = [SeqSpec(t, c, n) for t, (c, n) in zip(tables, chunks)]
    metadata = build_metadata(seqs, BLOCK_SIZE, num_padding_tokens=num_padding_tokens, device=device)
    metadata.extra.update(extra or {})
    rows = metadata.num_tokens
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    backend = backend_cls(HEADS, KV_HEADS, HEAD_DIM, scale=HEAD_DIM ** -0.5, sliding_window=window)
    backend_cls.prepare_metadata(metadata)
    out = backend.forward(q, k, v, pool[:, LAYER], metadata)
    return out, pool


def _same_as_torch(chunks, dtype, device, window=None, **kwargs):
    out, pool = _run(TritonAttentionBackend, chunks, dtype, device, window, **kwargs)
    expected_out, expected_pool = _run(TorchAttentionBackend, chunks, dtype, device, window,
                                       num_padding_tokens=kwargs.get("num_padding_tokens", 0))
    torch.testing.assert_close(pool, expected_pool, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, **tolerances(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 6])
def test_mixed_batch_matches_torch_backend(dtype, window, device):
    _same_as_torch(MIXED, dtype, device, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_batch_matches_torch_backend(dtype, window, device):
    _same_as_torch(DECODE_ONLY, dtype, device, window)


@pytest.mark.parametrize("chunks", [MIXED, DECODE_ONLY])
def test_padding_rows_give_zeros_and_write_nothing(chunks, device):
    _same_as_torch(chunks, torch.float32, device, num_padding_tokens=3)
    out, _ = _run(TritonAttentionBackend, chunks, torch.float32, device, None, num_padding_tokens=3)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


def test_fixed_decode_split_count(device):
    _same_as_torch(DECODE_ONLY, torch.float32, device, extra={"decode_num_splits": 4})
