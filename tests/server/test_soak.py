"""Soak (issue 11, point 8): 300 streamed requests from 128 concurrent clients against a
``tandem serve`` subprocess of the tiny Llama, with mixed sampling parameters (greedy,
temperature/top_p/top_k, penalties, seeds, stop strings, logprobs), n up to 2, completions and
chat, and about 30% of the clients closing the connection after a random number of chunks.

Must hold: no answer ≥ 500 and no error event in a stream; every stream read to its end ends with
``[DONE]``; /health 200 at every poll meanwhile; no ``engine_exception`` counted; within a few
seconds of the end no KV block in use and no request running or waiting; and a greedy control
request answering, after the soak as before it, what the offline ``tandem.LLM`` answers (the
oracle). The figures (requests, disconnects, wall time, tokens) are printed.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest

from tandem import SamplingParams
from tests.helpers.schema_fuzz import HealthWatch
from tests.router.instances import MODEL_NAME, InstanceProcess, scrape, wait_for

pytestmark = pytest.mark.slow

NUM_REQUESTS = 300
NUM_CLIENTS = 128
DISCONNECT_SHARE = 0.3
CONTROL_PROMPT = "After three hundred streams the control"
CONTROL_TOKENS = 16
ENGINE_FAILURES = "tandem:request_errors_total{reason=engine_exception}"
# More seats than the default test instance, so that 128 clients keep a full batch busy, and
# fewer KV blocks than 32 seats ask for (40 blocks of 16 tokens): preemption happens too.
FLAGS = ("--max-num-seqs", "32", "--num-kv-blocks", "40", "--max-num-batched-tokens", "512")
WORDS = "the engine streams tokens to many clients while some of them leave early".split()


@dataclass(slots=True)
class Outcome:
    status: int
    chunks: int
    disconnected: bool
    done: bool
    errors: list[str]


def sampling(rng: random.Random) -> dict:
    """One of the mixes, drawn per request."""
    kind = rng.choice(["greedy", "nucleus", "penalties", "seeded", "stops", "logprobs"])
    return {
        "greedy": {"temperature": 0},
        "nucleus": {"temperature": rng.choice([0.7, 1.0, 1.3]), "top_p": rng.choice([0.5, 0.9]),
                    "top_k": rng.choice([5, 20, -1])},
        "penalties": {"temperature": 0.8, "presence_penalty": rng.uniform(-2, 2),
                      "frequency_penalty": rng.uniform(-2, 2), "repetition_penalty": rng.choice([0.8, 1.2, 2.0])},
        "seeded": {"temperature": 1.0, "seed": rng.randrange(2**32), "min_p": 0.05},
        "stops": {"temperature": 0.5, "stop": rng.sample(["e", "th", " ", "\n", "s"], 2),
                  "include_stop_str_in_output": rng.random() < 0.5},
        "logprobs": {"temperature": 0.9, "logprobs": rng.choice([0, 3, 5])},
    }[kind]


def request_of(index: int, rng: random.Random) -> tuple[str, dict]:
    params = sampling(rng)
    common = {"model": MODEL_NAME, "stream": True, "n": rng.choice([1, 2]), "max_tokens": rng.randint(4, 32),
              "stream_options": {"include_usage": rng.random() < 0.5}}
    prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 24))) + f" {index}"
    if rng.random() < 0.35:
        if "logprobs" in params:
            params = {"temperature": params["temperature"], "logprobs": True, "top_logprobs": params["logprobs"]}
        return "/v1/chat/completions", {**common, **params, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, **params, "prompt": prompt}


async def one(client: httpx.AsyncClient, url: str, path: str, body: dict, leave_after: int | None) -> Outcome:
    chunks, errors, done = 0, [], False
    async with client.stream("POST", f"{url}{path}", json=body) as response:
        if response.status_code != 200:
            return Outcome(response.status_code, 0, False, False, [(await response.aread()).decode()[:300]])
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            if "error" in json.loads(data):
                errors.append(data[:300])
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return Outcome(200, chunks, leave_after is not None and not done, done, errors)


async def soak(url: str, seed: int) -> list[Outcome]:
    rng = random.Random(seed)
    plan = [(*request_of(i, rng), rng.randint(1, 6) if rng.random() < DISCONNECT_SHARE else None)
            for i in range(NUM_REQUESTS)]
    seats = asyncio.Semaphore(NUM_CLIENTS)
    limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)

    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as client:
        async def client_task(path: str, body: dict, leave_after: int | None) -> Outcome:
            async with seats:
                return await one(client, url, path, body, leave_after)

        return await asyncio.gather(*(client_task(*p) for p in plan))


def control_text(url: str) -> str:
    body = {"model": MODEL_NAME, "prompt": CONTROL_PROMPT, "max_tokens": CONTROL_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    if response.status_code != 200:
        return f"<{response.status_code}: {response.text}>"
    return response.json()["choices"][0]["text"]


def idle_and_empty(url: str) -> bool:
    metrics = scrape(url)
    return (metrics["tandem:kv_blocks_used"], metrics["tandem:num_requests_running"],
            metrics["tandem:num_requests_waiting"]) == (0, 0, 0)


@pytest.fixture(scope="module")
def instance(model_dir, tmp_path_factory):
    proc = InstanceProcess(model_dir, tmp_path_factory.mktemp("soak-instance"), flags=FLAGS).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.mark.timeout(300)
def test_soak_of_300_streams_from_128_clients_with_disconnects(instance, offline, capsys):
    want = offline.generate(CONTROL_PROMPT, SamplingParams(temperature=0, max_tokens=CONTROL_TOKENS))[0].outputs[0].text
    assert control_text(instance.url) == want
    tokens_before = scrape(instance.url)["tandem:generation_tokens_total"]

    start = time.monotonic()
    with HealthWatch([instance.url], interval_s=0.5) as watch:
        outcomes = asyncio.run(soak(instance.url, seed=11))
    wall_s = time.monotonic() - start
    freed = wait_for(lambda: idle_and_empty(instance.url), 5)
    metrics = scrape(instance.url)
    disconnects = sum(o.disconnected for o in outcomes)
    with capsys.disabled():
        print(f"\nsoak: {len(outcomes)} streamed requests from {NUM_CLIENTS} clients in {wall_s:.1f} s, "
              f"{disconnects} disconnected mid-stream, "
              f"{metrics['tandem:generation_tokens_total'] - tokens_before:.0f} tokens generated, "
              f"{sum(o.chunks for o in outcomes)} chunks read, "
              f"{metrics.get('tandem:num_preemptions_total', 0):.0f} preemptions in all")

    assert [o for o in outcomes if o.status >= 500] == []
    assert [o for o in outcomes if o.status != 200] == []  # the mixes are all valid requests
    assert [o.errors for o in outcomes if o.errors] == []
    assert all(o.done for o in outcomes if not o.disconnected)
    assert 0.2 * NUM_REQUESTS <= disconnects <= 0.4 * NUM_REQUESTS
    assert watch.failures == []
    assert freed, {k: v for k, v in metrics.items() if "kv_blocks" in k or "num_requests" in k}
    assert metrics.get(ENGINE_FAILURES, 0) == 0
    assert metrics["tandem:num_preemptions_total"] > 0  # the pool was under pressure
    assert control_text(instance.url) == want
