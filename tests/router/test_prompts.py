"""What the router reads from request bodies and the bodies it derives, on hand-written cases:
the length estimate (exact for token ids, characters // 4 for text), the routing key (ids, or
UTF-8 bytes), and the prefill / decode bodies of the disaggregated flow."""
from __future__ import annotations

import pytest

from tandem.router.prompts import (
    PromptInfo,
    chat_prompt,
    client_body,
    completion_prompt,
    decode_body,
    needs_prompt_computed,
    prefill_body,
)


@pytest.mark.parametrize("prompt, expected", [
    ("abcdefghi", PromptInfo(list(b"abcdefghi"), 2)),          # 9 characters // 4
    (["abcd"], PromptInfo(list(b"abcd"), 1)),                   # a list of one string
    ("héllo wörld", PromptInfo(list("héllo wörld".encode()), 2)),  # 11 characters, 13 bytes
    ([5, 6, 7], PromptInfo([5, 6, 7], 3, token_ids=True)),      # token ids: exact
    ([[5, 6, 7, 8]], PromptInfo([5, 6, 7, 8], 4, token_ids=True)),  # a list of one id list
    (["a", "b"], PromptInfo([], None)),                         # several prompts
    ([[1], [2]], PromptInfo([], None)),
    ([True, 1], PromptInfo([], None)),                          # booleans are not token ids
    ([2**63 - 1, 0], PromptInfo([2**63 - 1, 0], 2, token_ids=True)),  # the int64 range, which policies pack
    ([5, 2**63], PromptInfo([], None)),                         # beyond it: no vocabulary has these
    ([[-1, 5]], PromptInfo([], None)),
    ([], PromptInfo([], None)),
    (5, PromptInfo([], None)),
])
def test_completion_prompts(prompt, expected):
    assert completion_prompt({"prompt": prompt}) == expected


def test_a_completion_without_prompt_is_not_disaggregatable():
    assert completion_prompt({"model": "m"}) == PromptInfo([], None)


def test_chat_prompts_count_the_characters_of_every_content():
    body = {"messages": [
        {"role": "system", "content": "Be brief."},                                  # 9
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},  # 8
        {"role": "assistant", "content": None},                                      # 0
    ]}
    assert chat_prompt(body) == PromptInfo(list(b"system\nBe brief.\nuser\nHi there\nassistant\n\n"), 4)


@pytest.mark.parametrize("body", [{}, {"messages": []}, {"messages": "hi"}, {"messages": ["hi"]},
                                  {"messages": [{"role": "user", "content": 5}]}])
def test_unreadable_chats_are_not_disaggregatable(body):
    assert chat_prompt(body) == PromptInfo([], None)


def test_the_prefill_body_asks_for_one_token_and_the_hand_over():
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "n": 3, "logprobs": 2, "echo": True,
            "temperature": 0, "min_tokens": 5, "stop": ["\n"], "kv_transfer_params": {"block_ids": [1]}}
    assert prefill_body(body) == {"model": "tiny", "prompt": "x", "max_tokens": 1, "stream": False,
                                  "n": 1, "temperature": 0, "stop": ["\n"],
                                  "kv_transfer_params": {"do_remote_decode": True}}


def test_the_chat_prefill_body_drops_max_completion_tokens_and_logprobs():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
            "logprobs": True, "top_logprobs": 3}
    assert prefill_body(body) == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                  "stream": False, "n": 1,
                                  "kv_transfer_params": {"do_remote_decode": True}}


def test_the_decode_body_is_the_client_body_plus_the_hand_over():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "kv_transfer_params": {"forged": True}}
    params = {"engine_id": "p0", "block_ids": [3, 4], "num_tokens": 20, "compat_hash": "ab12"}
    assert decode_body(body, params) == {
        "prompt": "x", "max_tokens": 50, "stream": True,
        "kv_transfer_params": {"engine_id": "p0", "block_ids": [3, 4], "num_tokens": 20,
                               "compat_hash": "ab12", "do_remote_prefill": True}}
    assert decode_body(body, None) == {"prompt": "x", "max_tokens": 50, "stream": True}
    assert client_body(body) == {"prompt": "x", "max_tokens": 50, "stream": True}
    assert body["kv_transfer_params"] == {"forged": True}  # the client's dict is not changed


@pytest.mark.parametrize("body, needed", [
    ({"prompt": "x", "max_tokens": 0}, True),
    ({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 5}, True),
    ({"prompt": "x", "echo": True, "logprobs": 0}, True),
    ({"prompt": "x", "prompt_logprobs": 0}, True),
    ({"messages": [], "prompt_logprobs": 3}, True),
    ({"prompt": "x", "echo": True}, False),          # the text alone: the decode instance has it
    ({"prompt": "x", "logprobs": 3}, False),         # generated tokens' logprobs only
    ({"prompt": "x", "max_tokens": 1, "logit_bias": {"5": 100}, "bad_words": ["a"]}, False),
    ({"prompt": "x", "prompt_logprobs": None, "max_tokens": None}, False),
])
def test_requests_about_the_prompt_itself_need_it_computed_where_answered(body, needed):
    assert needs_prompt_computed(body) is needed
