"""The offline LLM refuses what the server refuses, with a ValueError naming the field, before
anything runs — and stays usable: a refused batch leaves no request and no block behind.

The tiny Llama: vocabulary 512; with 64 KV blocks of 16 its context is 512 tokens."""
from __future__ import annotations

import math

import pytest

from tandem import LLM, SamplingParams
from tests.helpers.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, max_num_seqs=8, num_threads=1)


def _mutated(**fields) -> SamplingParams:
    params = SamplingParams(max_tokens=2)
    for name, value in fields.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("prompt, params, field", [
    ([5, 512], SamplingParams(max_tokens=2), "prompt"),
    ([-1], SamplingParams(max_tokens=2), "prompt"),
    ([], SamplingParams(max_tokens=2), "prompt"),
    ("\ud800 hi", SamplingParams(max_tokens=2), "prompt"),
    ("x", SamplingParams(max_tokens=2, stop_token_ids=[512]), "stop_token_ids"),
    ("x", SamplingParams(max_tokens=2, logprobs=21), "logprobs"),
    ("x", SamplingParams(max_tokens=2, prompt_logprobs=21), "prompt_logprobs"),
    ("x", SamplingParams(max_tokens=2, n=9), "n"),
    ("x", SamplingParams(max_tokens=600), "max_tokens"),
    ("x", SamplingParams(max_tokens=None, min_tokens=600), "min_tokens"),
    ([7] * 512, SamplingParams(max_tokens=None), "prompt"),
    ("x", _mutated(temperature=math.nan), "temperature"),
    ("x", _mutated(top_p=math.inf), "top_p"),
    ("x", _mutated(seed=2**64), "seed"),
    ("x", _mutated(stop=["\udfff"]), "stop"),
    ("x", _mutated(min_tokens=3), "min_tokens"),
])
def test_the_offline_api_refuses_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=rf"(^|\.){field} ") as info:
        llm.generate(["fine", prompt], params)
    assert info.value.param == field
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"), ({"seed": 2**63}, "seed"),
    ({"stop": ["\ud800"]}, "stop"), ({"stop": ["s"] * 65}, "stop"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
])
def test_sampling_params_refuse_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} "):
        SamplingParams(**kwargs)


def test_after_refusals_the_engine_still_generates(llm):
    want = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    with pytest.raises(ValueError):
        llm.generate(["def f(x):", [512]], SamplingParams(temperature=0, max_tokens=6))
    again = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].token_ids
    assert again == want and len(want) == 6


def test_a_request_id_in_use_is_refused_and_the_first_request_runs_on(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    want = llm.generate("def f(x):", params)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("def f(x):", params, request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request("class A:", params, request_id="dup")
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    assert [out.request_id for out in finals] == ["dup"]
    assert finals[0].outputs[0].token_ids == want and len(want) == 4


def test_max_logprobs_is_configurable():
    small = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16, max_logprobs=2, num_threads=1)
    with pytest.raises(ValueError, match="logprobs must be at most 2 "):
        small.generate("x", SamplingParams(max_tokens=1, logprobs=3))
    out = small.generate("x", SamplingParams(max_tokens=1, logprobs=2))[0].outputs[0]
    assert len(out.logprobs[0]) >= 2
