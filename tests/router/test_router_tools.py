"""Tool calling through the router, colocated and disaggregated: nothing on the way drops
``tools``, ``tool_choice`` or the constraint they imply. The prefill instance computes the first
token under the same schema (its body keeps the tools), the decode instance the rest; greedy
answers through either router must equal a direct answer of a colocated instance, streamed or
not. Every instance serves "auto" with the hermes parser."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.router.instances import MODEL_NAME, InstanceProcess, dispatched, role_env, running_router

TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"enum": ["Paris", "Rome"]}}}}},
         {"type": "function", "function": {"name": "lights", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["on"],
             "properties": {"on": {"type": "boolean"}}}}}]
FORCED = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
BODIES = {
    "named": {"tool_choice": {"type": "function", "function": {"name": "weather"}}},
    "required": {"tool_choice": "required", "parallel_tool_calls": False},
    "auto": {"structured_outputs": {"regex": FORCED.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")}},
}


def chat(url: str, kind: str, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Rome?"}], "tools": TOOLS,
            "temperature": 0.0, **BODIES[kind], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def answer(url: str, kind: str) -> tuple:
    """(content, [(name, arguments)], finish_reason) of a plain answer."""
    response = chat(url, kind)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    calls = choice["message"]["tool_calls"]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    return (choice["message"]["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
            choice["finish_reason"])


def streamed(url: str, kind: str) -> tuple:
    """The same, built from the stream's deltas."""
    content, calls, finish = "", [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Rome?"}], "tools": TOOLS,
            "temperature": 0.0, "stream": True, **BODIES[kind]}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            (choice,) = json.loads(line[6:])["choices"]
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                if delta.get("id"):
                    calls.append([delta["function"]["name"], ""])
                calls[delta["index"]][1] += delta["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content or None, [tuple(c) for c in calls], finish


@pytest.fixture(scope="module")
def oracle(model_dir, log_dir) -> Iterator[InstanceProcess]:
    proc = InstanceProcess(model_dir, log_dir, flags=TOOL_FLAGS).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def expected(oracle) -> dict[str, tuple]:
    answers = {kind: answer(oracle.url, kind) for kind in BODIES}
    assert answers["auto"] == ("Sure.", [("weather", '{"city": "Rome"}')], "tool_calls")
    assert answers["named"][1][0][0] == "weather" and answers["named"][2] == "stop"
    assert answers["required"][2] == "tool_calls" and len(answers["required"][1]) == 1
    return answers


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(BODIES))
def test_colocated_router_relays_tool_calls(oracle, expected, kind):
    with running_router([(oracle.url, "both")]) as router:
        assert answer(router.url, kind) == expected[kind]
        assert streamed(router.url, kind) == expected[kind]


@pytest.fixture(scope="module")
def disaggregated(model_dir, log_dir) -> Iterator[str]:
    pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")
    prefill = InstanceProcess(model_dir, log_dir, flags=TOOL_FLAGS, **role_env("prefill", 5.0)).start()
    decode = InstanceProcess(model_dir, log_dir, flags=TOOL_FLAGS, **role_env("decode", 5.0)).start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        with running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
            yield router.url
    finally:
        prefill.stop()
        decode.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", sorted(BODIES))
def test_disaggregated_router_serves_tool_calls(disaggregated, expected, kind):
    before = dispatched(disaggregated, "disaggregated")
    assert answer(disaggregated, kind) == expected[kind]
    assert streamed(disaggregated, kind) == expected[kind]
    assert dispatched(disaggregated, "disaggregated") - before == 2
