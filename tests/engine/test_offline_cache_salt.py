"""``cache_salt`` in the offline API (vLLM's prompt dicts) and next to the engine's own longrope
salt. Oracle: hand-computed cached counts — the full blocks of a prompt but its last token when
an earlier request of the same salt (and the same rope factors) computed them, else 0.
"""
from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidRequest
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import tiny_model_dir

BLOCK = 16
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, num_threads=1)


def cached(llm: LLM, prompt) -> int:
    return llm.generate(prompt, ONE_TOKEN)[0].num_cached_tokens


def test_generate_takes_vllm_prompt_dicts_with_a_salt(llm):
    tokens = _prompts(80, [2 * BLOCK + 3])[0]
    text = llm.get_tokenizer().decode(_prompts(81, [40])[0])
    assert cached(llm, {"prompt_token_ids": tokens, "cache_salt": "a"}) == 0
    assert cached(llm, {"prompt_token_ids": tokens, "cache_salt": "b"}) == 0
    assert cached(llm, tokens) == 0
    assert cached(llm, {"prompt_token_ids": tokens, "cache_salt": "a"}) == 2 * BLOCK
    assert cached(llm, {"prompt": text, "cache_salt": "a"}) == 0
    outs = llm.generate([{"prompt": text, "cache_salt": "a"}, {"prompt": text, "cache_salt": "b"}], ONE_TOKEN)
    num_tokens = len(llm.get_tokenizer().encode(text))
    assert num_tokens > BLOCK
    assert [o.num_cached_tokens for o in outs] == [(num_tokens - 1) // BLOCK * BLOCK, 0]


def test_chat_takes_a_salt(llm):
    conversation = [{"role": "user", "content": "A salted conversation, repeated. " * 5}]
    assert llm.chat(conversation, ONE_TOKEN, cache_salt="c")[0].num_cached_tokens == 0
    assert llm.chat(conversation, ONE_TOKEN, cache_salt="d")[0].num_cached_tokens == 0
    assert llm.chat(conversation, ONE_TOKEN, cache_salt="c")[0].num_cached_tokens > 0


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [5, 6], "cache_salt": ""}, "cache_salt must be a string of 1 to 256"),
    ({"prompt_token_ids": [5, 6], "cache_salt": 3}, "cache_salt must be a string of 1 to 256"),
    ({"prompt_token_ids": [5, 6], "salt": "a"}, "a prompt dict holds one of"),
    ({"prompt": "hi", "prompt_token_ids": [5]}, "a prompt dict holds one of"),
])
def test_a_malformed_prompt_dict_is_refused(llm, prompt, message):
    with pytest.raises(ValueError, match=message) as refused:
        llm.generate(prompt, ONE_TOKEN)
    if "cache_salt" in message:
        assert isinstance(refused.value, InvalidRequest) and refused.value.param == "cache_salt"
    assert not llm.engine.has_unfinished_requests()


def test_a_tenant_salt_keeps_longrope_short_and_long_prompts_apart():
    """Longrope rotates a prompt longer than its original context (32 here) with other factors,
    so a long prompt must not reuse a short prompt's blocks even under one tenant's salt."""
    llm = LLM(model=str(tiny_model_dir("phi3_longrope")), num_kv_blocks=64, num_threads=1)
    long_prompt = _prompts(82, [40])[0]
    short_prompt = long_prompt[:20]
    salted = lambda tokens, salt="t": {"prompt_token_ids": tokens, "cache_salt": salt}  # noqa: E731
    assert cached(llm, salted(long_prompt)) == 0
    assert cached(llm, salted(short_prompt)) == 0  # same tokens, short factors: nothing shared
    assert cached(llm, salted(short_prompt)) == BLOCK
    assert cached(llm, salted(short_prompt, "u")) == 0
    assert cached(llm, short_prompt) == 0
    assert cached(llm, salted(long_prompt)) == 2 * BLOCK
