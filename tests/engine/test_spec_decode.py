"""Speculative decoding with n-gram drafts changes how many tokens a step produces, never which:
greedy output (tokens and logprobs) equals the output without it — the oracle — across models,
backends, penalties, stops and n > 1, and sampled output keeps its distribution. The tiny
models fall into loops, so their drafts are often accepted."""
from __future__ import annotations

from collections import Counter

import pytest

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import MIXED_LENGTHS, _prompts
from tests.helpers.tiny_models import tiny_model_dir


def _run(kind, prompts, params, k, num_kv_blocks=256, **engine):
    llm = LLM(model=str(tiny_model_dir(kind)), num_kv_blocks=num_kv_blocks, num_speculative_tokens=k,
              speculative_ngram_min=1, **engine)
    counts = Counter()
    step = llm.engine.step

    def counting_step():
        outputs = step()
        counts["drafts"] += llm.engine.last_step.num_draft_tokens
        counts["accepted"] += llm.engine.last_step.num_accepted_draft_tokens
        return outputs

    llm.engine.step = counting_step
    outputs = llm.generate(prompts, params)
    counts["blocks_in_use"] = llm.engine.scheduler.kv.stats().num_used_blocks
    return outputs, counts


def _same_outputs(a, b, logprobs=False):
    for x, y in zip(a, b):
        assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
        assert [o.text for o in x.outputs] == [o.text for o in y.outputs]
        assert [o.finish_reason for o in x.outputs] == [o.finish_reason for o in y.outputs]
        if logprobs:
            for ox, oy in zip(x.outputs, y.outputs):
                assert len(ox.logprobs) == len(oy.logprobs) == len(ox.token_ids)
                for ex, ey in zip(ox.logprobs, oy.logprobs):
                    assert ex.keys() == ey.keys()
                    assert all(abs(ex[t].logprob - ey[t].logprob) < 1e-4 for t in ex)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3", "gemma3"])
def test_greedy_output_is_unchanged(kind):
    prompts = _prompts(1, MIXED_LENGTHS)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    expected, _ = _run(kind, prompts, params, k=0)
    got, counts = _run(kind, prompts, params, k=4)
    _same_outputs(got, expected, logprobs=True)
    assert counts["accepted"] > 0 and counts["drafts"] > counts["accepted"]  # both paths taken


@pytest.mark.timeout(900)
def test_greedy_output_is_unchanged_with_the_triton_backend():
    prompts = _prompts(2, [3, 20])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected, _ = _run("llama", prompts, params, k=0, attention_backend="triton")
    got, counts = _run("llama", prompts, params, k=3, attention_backend="triton")
    _same_outputs(got, expected)
    assert counts["accepted"] > 0


def test_penalties_min_tokens_stops_and_n():
    prompts = _prompts(3, [4, 17, 30])
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.2, min_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" the", "\n"], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=25, n=2, ignore_eos=True, logprobs=1),
    ]
    expected, _ = _run("llama", prompts, params, k=0)
    got, counts = _run("llama", prompts, params, k=4)
    _same_outputs(got, expected)
    assert counts["accepted"] > 0


def test_sampling_draws_the_same_random_numbers_until_a_draft_is_rejected():
    """Seeded sampling: a step checking drafts samples its first row with the random number the
    step without drafts would use, and each further row with the next one, so with the same
    seeds both runs agree token for token until the first rejected draft, and a spec run is
    reproducible. (Each row samples from the model's distribution given the drafts before it, so
    the output keeps its distribution; the greedy tests above check those distributions.)"""
    prompt = _prompts(5, [12])[0]
    params = [SamplingParams(temperature=0.6, max_tokens=8, seed=s, ignore_eos=True) for s in range(64)]
    plain, _ = _run("llama", [prompt] * 64, params, k=0)
    spec, counts = _run("llama", [prompt] * 64, params, k=4)
    again, _ = _run("llama", [prompt] * 64, params, k=4)
    assert counts["accepted"] > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in spec]
    assert all(a.outputs[0].token_ids[:2] == b.outputs[0].token_ids[:2] for a, b in zip(plain, spec))
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, spec))
    assert same < 64  # rejections happen, and change what follows them


def test_preemption_and_prefix_caching_with_drafts_match_hf():
    """A pool too small for the batch: sequences checking drafts get preempted and recomputed,
    share prompt prefixes through the cache, and still produce HF's greedy tokens; no block is
    left in use at the end."""
    from tests.engine.test_greedy_vs_hf import hf_greedy

    path = tiny_model_dir("mistral")
    shared = _prompts(7, [20])[0]
    prompts = [shared + p for p in _prompts(8, [10, 11, 9, 3])] + _prompts(9, [17, 40])
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs, counts = _run("mistral", prompts, params, k=4, num_kv_blocks=11, max_num_batched_tokens=64)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0 and counts["accepted"] > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
    assert counts["blocks_in_use"] == 0
