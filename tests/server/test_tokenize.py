"""POST /tokenize and /detokenize through a real uvicorn, against the HF tokenizer and its chat
template (``AutoTokenizer``) as the oracle."""
from __future__ import annotations

import json

import pytest

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Print hello."}]


def _tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tokenize_prompt_equals_hf(http, hf_tokenizer, add_special_tokens):
    prompt = "def main():\n    print('héllo')"
    body = {"prompt": prompt} if add_special_tokens is None else {
        "prompt": prompt, "add_special_tokens": add_special_tokens}
    want = hf_tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
    assert _tokenize(http, model="tiny", **body) == {"tokens": want, "count": len(want),
                                                     "max_model_len": 512, "token_strs": None}


def test_tokenize_prompt_adds_bos_by_default(http, hf_tokenizer):
    """The tiny Llama has a BOS token: the defaults must differ, or the test above proves nothing."""
    assert hf_tokenizer.bos_token_id is not None
    tokens = _tokenize(http, prompt="x")["tokens"]
    assert tokens[0] == hf_tokenizer.bos_token_id
    assert _tokenize(http, prompt="x", add_special_tokens=False)["tokens"] == tokens[1:]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_equals_the_hf_chat_template(http, hf_tokenizer, add_generation_prompt):
    text = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
    want = hf_tokenizer.encode(text, add_special_tokens=False)
    got = _tokenize(http, messages=MESSAGES, add_generation_prompt=add_generation_prompt)
    assert (got["tokens"], got["count"]) == (want, len(want))


def test_tokenize_chat_count_equals_chat_usage(http):
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert _tokenize(http, messages=MESSAGES)["count"] == chat["usage"]["prompt_tokens"]


def test_tokenize_token_strs_equal_hf(http, hf_tokenizer):
    got = _tokenize(http, prompt="import os", return_token_strs=True)
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(got["tokens"])


def test_detokenize_equals_hf(http, hf_tokenizer):
    ids = hf_tokenizer.encode("def main():\n    return 'ünïcode'")
    r = http.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf_tokenizer.decode(ids)}


def test_tokenize_then_detokenize_round_trips(http):
    text = "for i in range(10):\n    print(i)"
    tokens = _tokenize(http, prompt=text, add_special_tokens=False)["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_in_openai_shape(http, path, body, param):
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("path, body", [("/tokenize", {"model": "other", "prompt": "x"}),
                                        ("/detokenize", {"model": "other", "tokens": [1]})])
def test_another_model_is_a_404(http, path, body):
    r = http.post(path, json=body)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
