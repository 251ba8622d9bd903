"""Decode through the fixed, padded buffers of tandem.worker.cuda_graphs gives the same greedy
tokens as the plain eager path. On the CPU the graphs are not recorded (``capture=False``): the
buffers, padding rows and slicing run eagerly, the Triton kernels under TRITON_INTERPRET=1.
Recording and replay on a GPU are checked by tests/gpu/test_cuda_graphs_cuda.py."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.plugins.attention_torch import TorchAttentionBackend
from tandem.worker.cuda_graphs import DecodeGraphs, batch_size_buckets
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import tiny_model_dir


def test_batch_size_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(8) == [1, 2, 4, 8]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError):
        batch_size_buckets(0)


def _install_static_graphs(llm: LLM, batch_sizes: list[int]) -> DecodeGraphs:
    worker = llm.engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_cache, worker.config.engine.block_size,
                          worker.info.max_model_len, batch_sizes, worker.attn_backend_cls, capture=False)
    worker.runner.graphs = graphs
    return graphs


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_padded_decode_buffers_match_eager(kind):
    path = str(tiny_model_dir(kind))
    # 5 prompts: decode batches of 5 exceed the largest bucket (eager), later ones of 3 pad to 4.
    prompts = _prompts(5, [3, 17, 20, 9, 33])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 9, 6, 12, 7)]
    expected = [o.outputs[0].token_ids
                for o in LLM(model=path, num_kv_blocks=48, attention_backend="torch").generate(prompts, params)]
    llm = LLM(model=path, num_kv_blocks=48, attention_backend="triton")
    graphs = _install_static_graphs(llm, [1, 2, 4])
    sizes = []
    run = graphs.run
    graphs.run = lambda inputs: sizes.append(inputs.metadata.num_seqs) or run(inputs)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    assert sizes and max(sizes) <= 4 and 3 in sizes  # padded to the bucket of 4
    # padding rows wrote no KV: the reserved block 0 (slot 0 onwards) is still all zeros
    assert not llm.engine.executor.worker.kv_cache[0].any()


def test_refuses_prefill_steps_and_oversized_batches():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=32, attention_backend="triton")
    graphs = _install_static_graphs(llm, [1, 2])
    calls = []
    run = graphs.run
    graphs.run = lambda inputs: calls.append(inputs.metadata.num_seqs) or run(inputs)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate(_prompts(3, [5, 6, 7]), params)
    assert calls == []  # prefill steps and decode batches of 3 > 2 never use the buffers
    llm.generate(_prompts(1, [5]), params)
    assert calls == [1, 1]  # the prefill step runs eagerly, both decode steps replay


def test_needs_cuda_and_a_backend_that_supports_graphs():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16, attention_backend="torch")
    e = llm.engine.executor.worker
    with pytest.raises(ValueError, match="does not support CUDA graphs"):
        DecodeGraphs(e.model, e.kv_cache, 16, e.info.max_model_len, [1], TorchAttentionBackend, capture=False)
    from tandem.plugins.attention_triton import TritonAttentionBackend

    with pytest.raises(ValueError, match="need a CUDA device"):
        DecodeGraphs(e.model, e.kv_cache, 16, e.info.max_model_len, [1], TritonAttentionBackend, capture=True)
    assert e.runner.graphs is None  # the worker captures nothing on the CPU
    assert torch.device(e.device).type == "cpu"
