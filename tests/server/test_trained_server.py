"""The server's features on trained weights (SmolLM2-135M-Instruct, float32), driven with the
official openai client, against HF transformers' greedy ``generate`` on the same GGUF file and
HF's rendering of its chat template (tests/helpers/trained.py). One server serves every check:
it is a prefill instance over NIXL, which serves requests without ``kv_transfer_params`` in full
(the colocated oracle of the hand-over); a decode instance joins it for the hand-over only."""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.trained import NEW_TOKENS, chat_ids, hf_greedy, hf_tokenizer, smollm2_path
from tests.server.server_helpers import ServerThread, running_server, scrape, server_config

pytestmark = pytest.mark.timeout(600)
MODEL = "smollm2"
QUESTIONS = ["What is the capital of France?", "Name three fruits.", "What colour is grass?"]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER}}]


def _config(role: str):
    return server_config(smollm2_path(), served_model_name=MODEL, dtype="float32", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "nixl",
        "disaggregation.allow_insecure_no_secret": True})


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running_server(_config("prefill")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(client, messages: list[dict], **body):
    body = {"temperature": 0, "max_tokens": NEW_TOKENS, **body}
    return client.chat.completions.create(model=MODEL, messages=messages, **body)


def _hf_text(messages: list[dict]) -> str:
    return hf_tokenizer().decode(hf_greedy(chat_ids(messages)), skip_special_tokens=True)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _multi_seq_steps(url: str) -> float:
    samples = scrape(url)
    return samples["tandem:batch_size_count"] - samples["tandem:batch_size_bucket{le=1.0}"]


def test_single_and_concurrent_greedy_chats_equal_hf(server, client):
    single = _ask(client, _user(QUESTIONS[0]))
    assert single.choices[0].message.content == _hf_text(_user(QUESTIONS[0]))
    assert "Paris" in single.choices[0].message.content
    assert single.usage.prompt_tokens == len(chat_ids(_user(QUESTIONS[0])))

    before = _multi_seq_steps(server.url)
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(lambda q: _ask(client, _user(q)), QUESTIONS))
    assert _multi_seq_steps(server.url) > before  # they were batched
    assert [a.choices[0].message.content for a in answers] == [_hf_text(_user(q)) for q in QUESTIONS]


def test_a_second_chat_turn_is_served_from_the_prefix_cache_like_a_cold_run(client):
    first = _user("My name is Ada and I live in Rome. What is two plus three?")
    answer = _ask(client, first).choices[0].message.content
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks. And what is the capital of France?"}]
    warm = _ask(client, second)
    cold = _ask(client, second, extra_body={"cache_salt": "a salt no earlier request used"})
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content == _hf_text(second)
    assert "Paris" in warm.choices[0].message.content


def test_json_schema_output_validates_and_carries_the_prompts_facts(client):
    prompt = _user("Alice is 31 years old. Give her name and age as JSON.")
    answer = _ask(client, prompt, max_tokens=24, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
    person = json.loads(answer.choices[0].message.content)
    jsonschema.validate(person, PERSON)
    assert person["name"] == "Alice" and person["age"] == 31


def test_a_tool_call_carries_the_city_of_the_prompt(client):
    answer = _ask(client, _user("What is the weather like in Tokyo today?"), max_tokens=16, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert answer.choices[0].finish_reason == "stop", answer.choices[0].message
    (call,) = answer.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert call.function.name == "get_weather" and arguments["city"] == "Tokyo"


@pytest.fixture(scope="module")
def decode(server) -> Iterator[ServerThread]:
    with running_server(_config("decode")) as srv:
        yield srv


def _completion(url: str, prompt: list[int], **extra) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_nixl_hand_over_to_a_decode_instance_gives_the_colocated_text(server, decode):
    prompt = chat_ids(_user(QUESTIONS[1]))
    params = _completion(server.url, prompt, max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert params["num_tokens"] == len(prompt)
    answer = _completion(decode.url, prompt, kv_transfer_params={**params, "do_remote_prefill": True})
    colocated = _completion(server.url, prompt)
    assert answer["choices"][0]["text"] == colocated["choices"][0]["text"]
    assert answer["choices"][0]["text"] == hf_tokenizer().decode(hf_greedy(prompt), skip_special_tokens=True)
    assert scrape(decode.url)["tandem:kv_transfer_bytes_total"] > 0  # read over NIXL, not recomputed
