"""SamplingParams' ranges and check_request's engine limits: each refusal is an InvalidRequest (a
ValueError) naming the field; values vLLM accepts are accepted. The limits are written out by hand
from the documented rules (docs/api.md, "What a request may ask"), not read from the code."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tandem.errors import lone_surrogate
from tandem.input_processor import RequestLimits, check_request
from tandem.errors import InvalidRequest
from tandem.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=100, max_model_len=50, max_num_seqs=4, max_logprobs=20)


@pytest.mark.parametrize("kwargs", [
    {"repetition_penalty": 5e-324}, {"repetition_penalty": 1e308}, {"temperature": 1e-300},
    {"temperature": 1e300}, {"temperature": 0}, {"top_p": 5e-324}, {"top_p": 1}, {"top_k": 10**9},
    {"top_k": -1}, {"top_k": 0}, {"min_p": 1}, {"min_p": 0.0}, {"presence_penalty": -2},
    {"frequency_penalty": 2}, {"seed": 2**63 - 1}, {"seed": -(2**63)}, {"seed": 0},
    {"min_tokens": 16, "max_tokens": 16}, {"min_tokens": 10**6, "max_tokens": None},
    {"stop": ["s"] * 64}, {"stop": ["z" * 1024]}, {"stop": "one"}, {"stop_token_ids": [0] * 1024},
    {"logprobs": 0}, {"prompt_logprobs": 10**6}, {"stop": ["smile \U0001F600"]},
])
def test_values_vllm_accepts_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -1e-300}, "temperature"), ({"temperature": 10**400}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"top_p": math.nan}, "top_p"), ({"top_p": 0}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"min_p": math.nan}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": math.inf}, "presence_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"), ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"), ({"seed": 1.0}, "seed"), ({"n": 0}, "n"), ({"n": True}, "n"),
    ({"max_tokens": -1}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"stop": [""]}, "stop"), ({"stop": [5]}, "stop"),
    ({"stop": ["s"] * 65}, "stop"), ({"stop": ["z" * 1025]}, "stop"), ({"stop": ["\ud800"]}, "stop"),
    ({"stop": "a\udfff"}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [0] * 1025}, "stop_token_ids"), ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logit_bias": {1: math.nan}}, "logit_bias"),
    ({"logit_bias": {1: 10**400}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"1": 1.0}}, "logit_bias"), ({"logit_bias": dict.fromkeys(range(65537), 1.0)}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"allowed_token_ids": [0] * 65537}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": ["  "]}, "bad_words"), ({"bad_words": [5]}, "bad_words"),
    ({"bad_words": ["w"] * 129}, "bad_words"), ({"bad_words": ["z" * 1025]}, "bad_words"),
    ({"bad_words": ["\ud800"]}, "bad_words"), ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
])
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest, match=rf"^SamplingParams\.{field} ") as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    assert isinstance(info.value, ValueError)


def test_a_huge_integer_is_refused_without_printing_it():
    with pytest.raises(InvalidRequest, match="an integer of 16610 bits"):
        SamplingParams(seed=10**5000)


@pytest.mark.parametrize("token_ids, kwargs, field, fragment", [
    ([], {}, "prompt", "is empty"),
    ([1, 100], {}, "prompt", "[100] outside the vocabulary [0, 100)"),
    ([-1], {}, "prompt", "[-1] outside"),
    ([1], {"stop_token_ids": [100]}, "stop_token_ids", "outside the vocabulary"),
    ([1], {"n": 5}, "n", "max_num_seqs (4)"),
    ([1], {"logprobs": 21}, "logprobs", "at most 20"),
    ([1], {"prompt_logprobs": 21}, "prompt_logprobs", "at most 20"),
    ([1] * 40, {"max_tokens": 11}, "max_tokens", "at most 10"),
    ([1] * 50, {"max_tokens": None}, "prompt", "no room for output"),
    ([1] * 40, {"max_tokens": None, "min_tokens": 11}, "min_tokens", "is 10"),
    ([1], {"allowed_token_ids": [3, 100]}, "allowed_token_ids", "[100] outside the vocabulary"),
    ([1], {"logit_bias": {100: 1.0}}, "logit_bias", "[100] outside the vocabulary"),
    ([1], {"bad_words_token_ids": [[5, 100]]}, "bad_words", "[100] outside the vocabulary"),
])
def test_check_request_refuses_what_the_engine_cannot_serve(token_ids, kwargs, field, fragment):
    with pytest.raises(InvalidRequest) as info:
        check_request(token_ids, SamplingParams(**kwargs), LIMITS)
    assert info.value.param == field
    assert str(info.value).startswith(f"{field} ")
    assert fragment in str(info.value)


@pytest.mark.parametrize("token_ids, kwargs", [
    ([0, 99], {"stop_token_ids": [99], "n": 4, "logprobs": 20, "max_tokens": 48}),
    ([1] * 49, {"max_tokens": None, "min_tokens": 1}),
    ([1] * 40, {"max_tokens": 10, "min_tokens": 10}),
    ([1] * 50, {"max_tokens": 0, "prompt_logprobs": 20}),
    ([1], {"allowed_token_ids": [0, 99], "logit_bias": {99: -100, 0: 100}, "bad_words_token_ids": [[99]]}),
])
def test_check_request_lets_through_what_fits_exactly(token_ids, kwargs):
    check_request(token_ids, SamplingParams(**kwargs), LIMITS)


def test_logprobs_are_bounded_by_the_vocabulary_too():
    small = RequestLimits(vocab_size=8, max_model_len=50, max_num_seqs=4, max_logprobs=20)
    with pytest.raises(InvalidRequest, match="at most 8"):
        check_request([1], SamplingParams(logprobs=9), small)


def test_params_changed_after_construction_are_checked_again():
    params = SamplingParams()
    params.temperature = math.nan
    with pytest.raises(InvalidRequest, match="temperature"):
        check_request([1], params, LIMITS)


def test_renamed_keeps_the_detail_under_the_clients_name():
    exc = InvalidRequest("logprobs", "must be at most 20", "SamplingParams")
    exc = exc.renamed({"logprobs": "top_logprobs"})
    assert (exc.param, str(exc)) == ("top_logprobs", "top_logprobs must be at most 20")


def test_lone_surrogates_are_found_and_pairs_are_not():
    assert lone_surrogate("ab\ud800c") == 2
    assert lone_surrogate("\udc00") == 0
    assert lone_surrogate("smile \U0001F600") is None
    assert lone_surrogate("") is None


def test_the_checks_import_without_torch():
    code = ("import sys; import tandem.input_processor, tandem.sampling_params; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
