"""The engine on CUDA replays decode steps from captured CUDA graphs and gives the same greedy
tokens as with ``enforce_eager``; batches larger than the largest graph fall back to eager."""
from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import tiny_model_dir

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_graphs_match_eager(kind):
    path = str(tiny_model_dir(kind))
    prompts = _prompts(7, [3, 17, 20, 9, 33, 1, 48])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (4, 9, 6, 12, 7, 20, 3)]
    got = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", num_kv_blocks=64, enforce_eager=eager,
                  cuda_graph_max_batch_size=4)
        graphs = llm.engine.executor.worker.runner.graphs
        assert (graphs is None) == eager
        got[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if not eager:
            assert graphs.batch_sizes == [1, 2, 4] and len(graphs.graphs) == 3
            assert graphs.num_replays > 0
    assert got[False] == got[True]


def test_graphs_with_seeded_sampling_and_logprobs():
    path = str(tiny_model_dir("llama"))
    prompts = _prompts(3, [5, 21, 2])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=2, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", num_kv_blocks=64, enforce_eager=eager)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in llm.generate(prompts, params)])
    assert [t for t, _ in runs[0]] == [t for t, _ in runs[1]]
    for (_, a), (_, b) in zip(*runs):
        assert a == pytest.approx(b, abs=1e-3)
