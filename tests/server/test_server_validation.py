"""Every bad request gets a 400 (404 for an unknown model) with an OpenAI error body naming the
problem, and none of them disturbs the server or a request running beside them.

The tiny model: vocabulary 512, context 512 tokens; the server's KV pool holds 63 blocks of 16."""
from __future__ import annotations

import json
import logging
import shutil
import threading
import uuid

import httpx
import pytest

from tandem import SamplingParams
from tests.server.server_helpers import running_server, server_config

CHAT = {"messages": [{"role": "user", "content": "hi"}]}

# (route, body, status, param, a fragment of the message)
CASES = [
    ("completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("completions", {"prompt": [1, "a"]}, 400, "prompt", "a list of token ids"),
    ("completions", {"max_tokens": 3}, 400, "prompt", "Field required"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "'gpt-4' does not exist"),
    ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"prompt": []}, 400, "prompt", "empty"),
    ("completions", {"prompt": ["ok", ""]}, 400, "prompt", "empty"),
    ("completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens", "context length (512"),
    ("completions", {"prompt": [7] * 500, "max_tokens": 20}, 400, "max_tokens", "context length"),
    ("completions", {"prompt": [7] * 512, "max_tokens": None}, 400, "prompt", "no room"),
    ("completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 0"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n", "greater than or equal to 1"),
    ("completions", {"prompt": "x", "n": 8, "max_tokens": 500}, 400, None, "KV"),
    ("completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs", "greater than or equal to 0"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", "at most 20"),
    ("completions", {"prompt": [5, 512]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": [[5], [-1]]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "less than or equal"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ("completions", {"prompt": "x", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs",
     "not available when stream"),
    ("completions", {"prompt": "x", "logit_bias": {"512": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ("completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias", "token ids written in decimal"),
    ("completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids", "non-empty"),
    ("completions", {"prompt": "x", "bad_words": [" "]}, 400, "bad_words", "non-whitespace"),
    ("chat/completions", {**CHAT, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "not available when stream"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages", "role"),
    ("chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", "greater"),
    ("chat/completions", {**CHAT, "max_tokens": 600}, 400, "max_tokens", "context length"),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs = true"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "at most 20"),
    ("chat/completions", {**CHAT, "logprobs": 3}, 400, "logprobs", "valid boolean"),
    ("chat/completions", {**CHAT, "model": "other"}, 404, "model", "does not exist"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format", "needs json_schema.schema"),
    # --- bounds checked before anything is tokenized (server.max_prompts and the rest, defaults)
    ("completions", {"prompt": ["x"] * 257, "max_tokens": 1}, 400, "prompt",
     "257 prompts; at most 256 per request (server.max_prompts)"),
    ("completions", {"prompt": "ab" * 524_288 + "c"}, 400, "prompt",
     "1048577 characters of text; at most 1048576 per request (server.max_prompt_chars)"),
    ("completions", {"prompt": ["a" * 524_288, "b" * 524_289]}, 400, "prompt", "server.max_prompt_chars"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 1025}, 400, "messages",
     "1025 messages; at most 1024 per request (server.max_messages)"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a" * 524_288},
                                       {"role": "user", "content": [{"type": "text", "text": "b" * 524_289}]}]},
     400, "messages", "1048577 characters of text"),
    ("completions", {"prompt": "x", "priority": 1_000_001}, 400, "priority",
     "must be an integer in [-1000000, 1000000] (server.max_abs_priority); got 1000001"),
    ("chat/completions", {**CHAT, "priority": -(2**62)}, 400, "priority", "server.max_abs_priority"),
]


def _check_error(response: httpx.Response, status: int, param: str | None, fragment: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
    assert error["param"] == param
    assert fragment in error["message"]


@pytest.mark.parametrize("route, body, status, param, fragment", CASES,
                         ids=[f"{r}-{i}" for i, (r, *_) in enumerate(CASES)])
def test_bad_request(server, route, body, status, param, fragment):
    response = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    _check_error(response, status, param, fragment)


@pytest.mark.parametrize("raw, fragment", [
    (b'{"prompt": "x", ', "not valid JSON"),
    (b'{"prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b'["x"]', "JSON object"),
    (b'', "JSON"),
])
def test_bad_body(server, raw, fragment):
    response = httpx.post(f"{server.url}/v1/completions", content=raw,
                          headers={"content-type": "application/json"}, timeout=30)
    _check_error(response, 400, None, fragment)


def test_unknown_fields_are_ignored_and_logged_once_per_name(server, caplog):
    name = f"frobnicate_{uuid.uuid4().hex}"
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        for _ in range(3):
            response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                                  json={"prompt": "x", "max_tokens": 2, name: 1, "best_of": 1})
            assert response.status_code == 200, response.text
    lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(lines) == 1, lines
    assert not any("best_of" in r.getMessage() for r in caplog.records)  # known and neutral


def test_bad_requests_do_not_disturb_a_running_request(server, offline):
    want = offline.generate("def main():", SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    result = {}

    def good():
        result["response"] = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "prompt": "def main():", "max_tokens": 60, "temperature": 0})

    thread = threading.Thread(target=good)
    thread.start()
    for route, body, status, param, fragment in CASES:
        _check_error(httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30), status, param, fragment)
    thread.join(60)
    assert result["response"].status_code == 200
    assert result["response"].json()["choices"][0]["text"] == want.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_model_without_chat_template(model_dir, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").unlink()
    with running_server(server_config(plain)) as srv:
        response = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, timeout=30)
        _check_error(response, 400, "messages", "has no chat template")
        ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
        assert json.loads(ok.text)["model"] == str(plain)


def test_null_means_the_default(server, offline):
    want = offline.generate("x", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    response = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 3, "temperature": 0, "n": None, "stream": None, "echo": None,
        "logprobs": None, "stop": None, "seed": None})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [want.text]


def test_json_object_response_format_gives_json(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        **CHAT, "max_tokens": 100, "temperature": 3.0, "seed": 1, "n": 4,
        "response_format": {"type": "json_object"}})
    assert response.status_code == 200, response.text
    for choice in response.json()["choices"]:
        text = choice["message"]["content"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


def test_text_response_format_is_served(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                          json={**CHAT, "max_tokens": 2, "response_format": {"type": "text"}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
