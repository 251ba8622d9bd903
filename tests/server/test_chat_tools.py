"""Tool calling end to end, with the official openai client against a real uvicorn server on the
tiny random-weight Llama: "required" and a named function are held to their JSON schemas by
constrained decoding, so even this model answers with calls whose arguments validate against
each tool's schema (checked with jsonschema), streamed or not, greedy or sampled; "auto" with
the hermes parser reads calls from text that a regex constraint makes the model write."""
from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.server.server_helpers import ServerThread, running_server, server_config

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}}}
LIGHTS = {"type": "object", "additionalProperties": False, "required": ["on"],
          "properties": {"on": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lights", "parameters": LIGHTS}}]
SCHEMAS = {"weather": WEATHER, "lights": LIGHTS}
MESSAGES = [{"role": "user", "content": "Paris?"}]
SAMPLING = [pytest.param({"temperature": 0.0}, id="greedy"), pytest.param({"temperature": 1.0, "seed": 3}, id="t1")]


@pytest.fixture(scope="module")
def tool_server(model_dir) -> Iterator[ServerThread]:
    """A server of its own that serves tool_choice "auto" with the hermes parser."""
    config = server_config(model_dir, served_model_name="tiny", enable_auto_tool_choice=True,
                           tool_call_parser="hermes")
    with running_server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, stream: bool = False, **body):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, stream=stream,
                                          **body)


def check_call(name: str, arguments: str, ids: set[str], call_id: str) -> None:
    assert call_id.startswith("chatcmpl-tool-") and call_id not in ids
    ids.add(call_id)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def streamed_calls(chunks) -> tuple[list[dict], list[str | None], str]:
    """The calls (id, name, arguments) the deltas build, per choice, plus finish reasons and content."""
    calls: dict[int, list[dict]] = {}
    finish: dict[int, str | None] = {}
    content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                built = calls.setdefault(choice.index, [])
                if delta.id is not None:
                    assert delta.index == len(built) and delta.type == "function"
                    built.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                built[delta.index]["arguments"] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return [calls.get(i, []) for i in sorted(finish)], [finish[i] for i in sorted(finish)], content


@pytest.mark.parametrize("sampling", SAMPLING)
def test_a_named_function_is_called_with_valid_arguments(client, sampling):
    choice = {"type": "function", "function": {"name": "weather"}}
    response = ask(client, tool_choice=choice, **sampling)
    (answer,) = response.choices
    assert answer.finish_reason == "stop"  # as OpenAI and vLLM: a named call keeps "stop"
    assert answer.message.content is None
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.function.name == "weather"
    check_call("weather", call.function.arguments, set(), call.id)

    (calls,), (finish,), content = streamed_calls(ask(client, stream=True, tool_choice=choice, **sampling))
    assert finish == "stop" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("weather", call.function.arguments)]


@pytest.mark.parametrize("sampling", SAMPLING)
def test_required_calls_validate_against_their_tools(client, sampling):
    # one call each: this random model never ends a list of calls by itself
    sampling = {**sampling, "parallel_tool_calls": False}
    response = ask(client, tool_choice="required", n=2, **sampling)
    ids: set[str] = set()
    for answer in response.choices:
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        assert len(answer.message.tool_calls) == 1
        for call in answer.message.tool_calls:
            check_call(call.function.name, call.function.arguments, ids, call.id)

    streamed, finish, content = streamed_calls(ask(client, stream=True, tool_choice="required", n=2, **sampling))
    assert finish == ["tool_calls", "tool_calls"] and content == ""
    stream_ids: set[str] = set()
    for calls in streamed:
        assert len(calls) == 1
        for call in calls:
            check_call(call["name"], call["arguments"], stream_ids, call["id"])
    if sampling["temperature"] == 0.0:  # greedy: the stream carries the same calls
        assert [[(c["name"], c["arguments"]) for c in calls] for calls in streamed] == \
            [[(c.function.name, c.function.arguments) for c in a.message.tool_calls] for a in response.choices]


FORCED = 'Sure.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'


def forced_text() -> dict:
    """A constraint that makes the model write FORCED, whatever its weights."""
    return {"structured_outputs": {"regex": FORCED.replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")}}


def test_auto_reads_the_calls_the_model_writes(client):
    response = ask(client, tool_choice="auto", extra_body=forced_text())
    (answer,) = response.choices
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content == "Sure."
    (call,) = answer.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("weather", {"city": "Paris"})

    (calls,), (finish,), content = streamed_calls(ask(client, stream=True, extra_body=forced_text()))
    assert (finish, content) == ("tool_calls", "Sure.")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("weather", {"city": "Paris"})]


def test_without_parallel_calls_auto_keeps_the_first(client):
    second = '<tool_call>{"name": "lights", "arguments": {"on": true}}</tool_call>'
    regex = {"regex": (FORCED + second).replace(".", r"\.").replace("{", r"\{").replace("}", r"\}")}
    response = ask(client, parallel_tool_calls=False, extra_body={"structured_outputs": regex})
    assert [c.function.name for c in response.choices[0].message.tool_calls] == ["weather"]
    (calls,), _, _ = streamed_calls(ask(client, stream=True, parallel_tool_calls=False,
                                        extra_body={"structured_outputs": regex}))
    assert [c["name"] for c in calls] == ["weather"]
    response = ask(client, extra_body={"structured_outputs": regex})
    assert [c.function.name for c in response.choices[0].message.tool_calls] == ["weather", "lights"]


def test_auto_without_calls_is_content(client):
    response = ask(client, tool_choice="auto", max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True})
    (answer,) = response.choices
    assert answer.message.tool_calls in (None, []) and answer.finish_reason in ("stop", "length")
    assert answer.message.content


def test_none_answers_text_only(client):
    response = ask(client, tool_choice="none", extra_body=forced_text())
    (answer,) = response.choices
    assert (answer.message.content, answer.message.tool_calls) in ((FORCED, None), (FORCED, []))
    assert answer.finish_reason == "stop"
