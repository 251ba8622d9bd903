"""The router in front of real ``tandem serve`` instances (one prefill, two decode subprocesses),
driven by the official ``openai`` client. Oracle: the same greedy request sent straight to a
colocated instance; the instances' own /metrics show which of them did the work."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.router.instances import (
    ADMIN,
    MODEL_NAME,
    completion,
    dispatched,
    running_router,
    scrape,
    upstream,
    wait_for,
)

LONG_PROMPT = ("The router sends the prompt to a prefill instance, which computes its KV cache and "
               "hands the blocks to a decode instance that streams the answer back. ") * 4
PROMPTS = {
    "text shorter than a block": "def main():",
    "text of many blocks": LONG_PROMPT,
    "one block of token ids": list(range(100, 116)),
    "token ids of many blocks": list(range(40, 90)),
}


@pytest.fixture(scope="module")
def router(cluster):
    instances = [(cluster.prefill.url, "prefill")] + [(d.url, "decode") for d in cluster.decode]
    with running_router(instances) as server:
        yield server


def client(router, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, **kwargs)


def generated(instance_url: str) -> float:
    return scrape(instance_url)["tandem:generation_tokens_total"]


def direct_text(cluster, prompt, max_tokens: int) -> str:
    """The oracle: a colocated instance's greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return completion(cluster.decode[0].url, body)["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_completions_through_prefill_and_decode_equal_a_direct_request(cluster, router, name, stream):
    prompt = PROMPTS[name]
    expected = direct_text(cluster, prompt, 12)
    before = generated(cluster.prefill.url)
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    if stream:
        text = "".join(c.choices[0].text for c in client(router).completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = client(router).completions.create(**kwargs).choices[0].text
    assert text == expected
    assert generated(cluster.prefill.url) == before + 1  # the prefill step: one token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_chat_through_prefill_and_decode_equals_a_direct_request(cluster, router, stream):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three prime numbers and nothing else."}]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0}
    expected = completion(cluster.decode[1].url, body, "/v1/chat/completions")["choices"][0]["message"]["content"]
    before = generated(cluster.prefill.url)
    chat = client(router).chat.completions
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in chat.create(model=MODEL_NAME, stream=True, **body)
                       if c.choices)
    else:
        text = chat.create(model=MODEL_NAME, **body).choices[0].message.content
    assert text == expected
    assert generated(cluster.prefill.url) == before + 1


def test_concurrent_streams_all_complete_and_spread_over_decode_instances(cluster, router):
    prompts = [f"Request number {i} asks about" + " the weather" * (i % 5) for i in range(16)]
    expected = [direct_text(cluster, p, 16) for p in prompts]
    decode_before = [upstream(router.url, d.url, "decode", "ok") for d in cluster.decode]
    aclient = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                                  temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(all_of_them()) == expected
    served = [upstream(router.url, d.url, "decode", "ok") - b for d, b in zip(cluster.decode, decode_before)]
    assert sum(served) == 16 and min(served) > 0  # least_loaded counts the router's in-flight requests
    samples = scrape(router.url)
    assert all(v == 0 for k, v in samples.items() if k.startswith("tandem:router_instance_in_flight"))


def test_time_to_first_token_is_measured_at_the_router(router):
    before = scrape(router.url)
    client_ttfts = []
    for i in range(3):
        start = time.monotonic()
        stream = client(router).completions.create(model=MODEL_NAME, prompt=f"Count to {i}:", max_tokens=8,
                                                   temperature=0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                client_ttfts.append(time.monotonic() - start)
                break
        stream.close()
    after = scrape(router.url)
    count = "tandem:router_time_to_first_token_seconds_count"
    total = "tandem:router_time_to_first_token_seconds_sum"
    assert after[count] - before[count] == 3
    # the router's clock starts after the client's and stops before the client sees the token
    assert 0 < after[total] - before[total] <= sum(client_ttfts)


def test_a_client_leaving_mid_stream_aborts_the_decode_request(cluster, router):
    errors = "tandem:request_errors_total{reason=client_disconnected}"
    before = {d.url: scrape(d.url).get(errors, 0.0) for d in cluster.decode}
    body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(3)][0].startswith("data: ")
    assert wait_for(lambda: sum(scrape(d.url).get(errors, 0.0) - before[d.url] for d in cluster.decode) == 1)
    assert wait_for(lambda: all(scrape(d.url)["tandem:num_requests_running"] == 0 for d in cluster.decode))
    assert wait_for(lambda: all(v == 0 for k, v in scrape(router.url).items()
                                if k.startswith("tandem:router_instance_in_flight")))


def test_short_prompts_go_straight_to_a_decode_instance(cluster):
    instances = [(cluster.prefill.url, "prefill"), (cluster.decode[0].url, "decode")]
    with running_router(instances, min_disaggregated_prompt_tokens=8) as router:
        cases = [("x" * 31, "short_prompt"),           # 31 characters // 4 = 7 < 8
                 ("x" * 32, "disaggregated"),          # 8
                 (list(range(200, 207)), "short_prompt"),  # 7 token ids
                 (list(range(200, 208)), "disaggregated")]
        for prompt, path in cases:
            before, routed = generated(cluster.prefill.url), dispatched(router.url, path)
            text = client(router).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                                     temperature=0).choices[0].text
            assert text == direct_text(cluster, prompt, 4)
            assert generated(cluster.prefill.url) == before + (path == "disaggregated")
            assert dispatched(router.url, path) == routed + 1


def test_models_and_health_come_from_the_instances(cluster, router):
    assert [m.id for m in client(router).models.list()] == [MODEL_NAME]
    assert httpx.get(f"{router.url}/health", timeout=10).json() == {"status": "ok"}  # no details
    health = httpx.get(f"{router.url}/health", timeout=10, headers=ADMIN)
    assert health.status_code == 200
    assert {(i["url"], i["role"], i["healthy"]) for i in health.json()["instances"]} == {
        (cluster.prefill.url, "prefill", True), (cluster.decode[0].url, "decode", True),
        (cluster.decode[1].url, "decode", True)}


def test_tokenize_detokenize_version_and_model_retrieve_pass_through(cluster, router):
    import tandem

    direct, routed = cluster.decode[0].url, router.url
    for path, body in (("/tokenize", {"prompt": LONG_PROMPT}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/detokenize", {"tokens": list(range(40, 90))}),
                       ("/detokenize", {"tokens": [10**9]})):
        want = httpx.post(f"{direct}{path}", json=body, timeout=10)
        got = httpx.post(f"{routed}{path}", json=body, timeout=10)
        assert (got.status_code, got.json()) == (want.status_code, want.json())
    assert httpx.get(f"{routed}/version", timeout=10).json() == {"version": tandem.__version__}
    assert client(router).models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client(router).models.retrieve("another/model")
    assert info.value.body["code"] == "model_not_found"


def test_the_router_api_key_guards_the_v1_routes(cluster):
    with running_router([(cluster.decode[0].url, "decode")], api_key="router-key") as router:
        with pytest.raises(openai.AuthenticationError):
            client(router).models.list()
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(f"{router.url}{path}", json=body, timeout=10).status_code == 401
        keyed = openai.OpenAI(base_url=f"{router.url}/v1", api_key="router-key", max_retries=0)
        assert keyed.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices[0].text


def test_logit_bias_and_token_constraints_reach_the_instance(cluster, router):
    """Through prefill and decode: the biased answer equals a direct biased request, and differs
    from the unbiased one (the field was not dropped on the way)."""
    prompt = list(range(40, 90))
    plain = direct_text(cluster, prompt, 6)
    fields = {"logit_bias": {"299": 100},
              "extra_body": {"bad_words": ["zzz"], "allowed_token_ids": list(range(300))}}
    before = dispatched(router.url, "disaggregated")
    got = client(router).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                            **fields)
    direct = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logit_bias": fields["logit_bias"],
              **fields["extra_body"]}
    assert got.choices[0].text == completion(cluster.decode[1].url, direct)["choices"][0]["text"]
    assert got.choices[0].text != plain
    assert dispatched(router.url, "disaggregated") == before + 1


@pytest.mark.parametrize("extra", [{"max_tokens": 0, "echo": True, "logprobs": 2},
                                   {"max_tokens": 3, "echo": True, "logprobs": 1},
                                   {"max_tokens": 2, "extra_body": {"prompt_logprobs": 2}}],
                         ids=["echo-max_tokens-0", "echo-logprobs", "prompt_logprobs"])
def test_prompt_logprob_requests_are_served_whole_by_one_instance(cluster, router, extra):
    prompt = list(range(40, 90))
    body = {"prompt": prompt, "temperature": 0, **{k: v for k, v in extra.items() if k != "extra_body"},
            **extra.get("extra_body", {})}
    want = completion(cluster.decode[0].url, body)
    before, routed = generated(cluster.prefill.url), dispatched(router.url, "needs_prompt")
    got = client(router).completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, **extra)
    choice, expected = got.choices[0].model_dump(), want["choices"][0]
    assert choice["text"] == expected["text"]
    assert choice["logprobs"] == expected["logprobs"]
    assert choice["prompt_logprobs"] == expected["prompt_logprobs"]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert generated(cluster.prefill.url) == before  # no prefill step
    assert dispatched(router.url, "needs_prompt") == routed + 1


def test_response_format_and_structured_outputs_pass_through(cluster, router):
    import json
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 50}},
              "required": ["ok", "n"], "additionalProperties": False}
    answer = client(router).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    stream = client(router).completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=50, temperature=1,
                                               seed=4, stream=True, extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("up", "down")
    with pytest.raises(openai.BadRequestError) as info:
        client(router).completions.create(model=MODEL_NAME, prompt="x", max_tokens=5,
                                          extra_body={"structured_outputs": {"regex": "(x"}})
    assert info.value.body["param"] == "structured_outputs"
    assert re.search("parenthesis", info.value.body["message"])
