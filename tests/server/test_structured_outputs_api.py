"""Structured outputs over HTTP with the official ``openai`` client, on the tiny random-weight
Llama: ``response_format`` json_schema (``chat.completions.parse`` with pydantic models) and
json_object, vLLM's ``structured_outputs`` on completions and chat, streamed and not; grammars
the backend refuses are 400s naming the field. Oracles: jsonschema, pydantic, ``re``."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "rooms": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                  "minItems": 1, "maxItems": 3},
        "kind": {"enum": ["flat", "house"]},
    },
    "required": ["city", "rooms", "kind"],
    "additionalProperties": False,
}


class Pet(BaseModel):
    name: str = Field(max_length=5)
    legs: int = Field(ge=0, le=8)
    species: Literal["cat", "dog", "bird"]


class Owner(BaseModel):
    owner: str = Field(max_length=5)
    pets: list[Pet] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Describe a home."}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_answers_validate(client, temperature):
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=temperature, seed=7, n=2, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "home", "schema": SCHEMA, "strict": True}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        completion = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Owner,
                                                   temperature=1.0, seed=seed, max_tokens=300)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Owner), message.content
        assert Owner.model_validate_json(message.content) == message.parsed


def test_streamed_json_schema_answer_validates(client):
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, seed=3, max_tokens=300, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "home", "schema": SCHEMA}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_chat_answers_start_an_object(client):
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, seed=1,
                                              temperature=1.0, response_format={"type": "json_object"})
    assert response.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("spec, check", [
    ({"regex": r"[xyz]{2}-\d{2}"}, lambda t: re.fullmatch(r"[xyz]{2}-\d{2}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'root ::= "<" ("a" | "b") ("a" | "b") ">"'}, lambda t: re.fullmatch(r"<[ab]{2}>", t)),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_structured_outputs_on_completions_and_chat(client, spec, check):
    completion = client.completions.create(model="tiny", prompt="The answer:", max_tokens=200, temperature=1.0,
                                           seed=2, n=2, extra_body={"structured_outputs": spec})
    for choice in completion.choices:
        assert choice.finish_reason == "stop" and check(choice.text), choice.text
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.0,
                                          extra_body={"structured_outputs": spec})
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    streamed = client.completions.create(model="tiny", prompt="The answer:", max_tokens=200, temperature=0.0,
                                         stream=True, extra_body={"structured_outputs": spec})
    assert check("".join(c.choices[0].text for c in streamed if c.choices))


@pytest.mark.parametrize("route, body, param, fragment", [
    ("completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis"),
    ("completions", {"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "nope"),
    ("completions", {"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "nonsense"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ("completions", {"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "schema"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad name!", "schema": {}}}}, "response_format", "json_schema.name"),
    ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("chat/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "one of them"),
    ("completions", {"guided_json": {"type": "object"}}, "guided_json", "structured_outputs"),
])
def test_refused_grammars_are_400s_naming_the_field(http, route, body, param, fragment):
    base = {"prompt": "x"} if route == "completions" else {"messages": MESSAGES}
    response = http.post(f"/v1/{route}", json={**base, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert fragment in error["message"], error
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
