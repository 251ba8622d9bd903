"""Tools and tool-call history reach the chat template as vLLM hands them over: the prompt a
server renders equals HF ``apply_chat_template`` called directly on the messages and tools
written out by hand (arguments as values, null content as "")."""
from __future__ import annotations

import json

import pytest

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping"}},
]
ARGS = {"city": "Paris", "when": ["today", 2]}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? And ping."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}},
        {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": ""}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": [{"type": "text", "text": "pong"}], "tool_call_id": "call_2"},
]
# What the template must get: what vLLM's chat_utils makes of HISTORY and TOOLS.
TEMPLATE_TOOLS = [
    {"type": "function", "function": {**TOOLS[0]["function"]}},
    {"type": "function", "function": {"name": "ping", "description": None, "parameters": None}},
]
TEMPLATE_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? And ping."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
        {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": {}}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    {"role": "tool", "content": "pong", "tool_call_id": "call_2"},
]


def oracle(hf_tokenizer, messages, tools=None) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def tokenized(http, **body) -> list[int]:
    response = http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_the_template_gets_the_tools_and_the_tool_history(http, hf_tokenizer):
    expected = oracle(hf_tokenizer, TEMPLATE_HISTORY, TEMPLATE_TOOLS)
    assert tokenized(http, messages=HISTORY, tools=TOOLS) == expected
    text = hf_tokenizer.decode(expected)
    assert '"arguments": {"city": "Paris", "when": ["today", 2]}' in text  # values, not JSON text
    assert "<tools>" in text and "<tool_response>\nsunny\n</tool_response>" in text


def test_without_tools_the_history_still_renders(http, hf_tokenizer):
    assert tokenized(http, messages=HISTORY) == oracle(hf_tokenizer, TEMPLATE_HISTORY)


def test_strict_reaches_the_template_only_when_sent(http, hf_tokenizer):
    tools = [{"type": "function", "function": {"name": "ping", "strict": True}}]
    expected = [{"type": "function", "function": {"name": "ping", "description": None, "parameters": None,
                                                  "strict": True}}]
    messages = [{"role": "user", "content": "hi"}]
    assert tokenized(http, messages=messages, tools=tools) == oracle(hf_tokenizer, messages, expected)


def test_chat_completions_render_the_same_prompt(http, hf_tokenizer):
    body = {"messages": HISTORY[1:4], "tools": TOOLS[1:], "max_tokens": 1, "tool_choice": "none"}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    expected = oracle(hf_tokenizer, TEMPLATE_HISTORY[1:4], TEMPLATE_TOOLS[1:])
    assert response.json()["usage"]["prompt_tokens"] == len(expected)
    message = response.json()["choices"][0]["message"]
    assert message["tool_calls"] == [] and isinstance(message["content"], str)  # "none": text only


def test_auto_needs_the_server_flags(http):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        response = http.post("/v1/chat/completions", json={"messages": HISTORY[:2], **body})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not in tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "required"},
     "tools", "parameters"),
    ({"tool_choice": "required", "stream": True, "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_refusals_name_the_field(http, body, param, words):
    response = http.post("/v1/chat/completions", json={"messages": HISTORY[:2], "tools": TOOLS, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
