"""Disaggregated prefill/decode end to end: the router (in this process), a prefill and a decode
``tandem serve`` subprocess handing KV blocks over through real NIXL/UCX on 127.0.0.1, and a
colocated instance as the oracle — greedy answers through the router must equal its answers token
for token. Faults kill the instances with -9; blocks are counted through each instance's /metrics.
"""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.router.instances import (
    KV_SECRET,
    MODEL_NAME,
    PAIR_EXPIRY_S,
    InstanceProcess,
    dispatched,
    role_env,
    running_router,
    scrape,
    wait_for,
)

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")

BLOCK = 16
EXPIRY_S = PAIR_EXPIRY_S


def body(prompt: list[int], **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, **extra}


def answer_tokens(url: str, prompt: list[int], **extra) -> list[str]:
    response = httpx.post(f"{url}/v1/completions", json=body(prompt, **extra), timeout=120, headers=KV_SECRET)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def blocks_held(url: str) -> tuple[float, float]:
    metrics = scrape(url)
    return metrics["tandem:kv_blocks_used"], metrics["tandem:kv_blocks_pending_release"]


def all_blocks_free(*urls: str, timeout_s: float = 10.0) -> bool:
    return wait_for(lambda: all(blocks_held(u) == (0, 0) for u in urls), timeout_s)


@dataclass
class Setup:
    oracle: InstanceProcess
    prefill: InstanceProcess
    decode: InstanceProcess
    router_url: str


@pytest.fixture(scope="module")
def oracle(colocated) -> InstanceProcess:
    return colocated


@pytest.fixture(scope="module")
def tcp_pair(model_dir, log_dir) -> Iterator[tuple[InstanceProcess, InstanceProcess]]:
    tcp = {"UCX_TLS": "tcp"}
    prefill = InstanceProcess(model_dir, log_dir, **role_env("prefill", EXPIRY_S, **tcp)).start()
    decode = InstanceProcess(model_dir, log_dir, **role_env("decode", EXPIRY_S, **tcp)).start()
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module", params=["default", "tcp"])
def setup(request, oracle) -> Iterator[Setup]:
    """Prefill and decode instances over UCX's default transports (the session's pair), or over
    TCP only."""
    prefill, decode = request.getfixturevalue("nixl_pair" if request.param == "default" else "tcp_pair")
    with running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
        yield Setup(oracle, prefill, decode, router.url)


@pytest.mark.timeout(180)
def test_greedy_answers_through_router_equal_colocated(setup):
    before = dispatched(setup.router_url, "disaggregated")
    long_prompt = _prompts(40, [4 * BLOCK + 3])[0]
    for prompt in [_prompts(41, [5])[0], _prompts(42, [BLOCK])[0], long_prompt]:
        assert answer_tokens(setup.router_url, prompt) == answer_tokens(setup.oracle.url, prompt)
    assert dispatched(setup.router_url, "disaggregated") - before == 3
    assert scrape(setup.decode.url)["tandem:kv_transfer_bytes_total"] > 0
    # the decode instance now caches the long prompt's first blocks: a prompt sharing 3 of them
    # reads only the rest from the prefill instance
    hits = scrape(setup.decode.url)["tandem:prefix_cache_hits_total"]
    shared = long_prompt[:3 * BLOCK] + _prompts(43, [BLOCK + 7])[0]
    assert answer_tokens(setup.router_url, shared) == answer_tokens(setup.oracle.url, shared)
    assert scrape(setup.decode.url)["tandem:prefix_cache_hits_total"] - hits >= 3 * BLOCK
    assert all_blocks_free(setup.prefill.url, setup.decode.url)


@pytest.mark.timeout(180)
def test_logit_bias_and_a_log_likelihood_request_through_the_router_equal_colocated(setup):
    """With the official client: a biased request goes through the hand-over; echo with
    max_tokens 0 (lm-evaluation-harness) is served whole by the decode instance, its prompt's
    logprobs as the oracle's."""
    router = openai.OpenAI(base_url=f"{setup.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = _prompts(46, [3 * BLOCK + 5])[0]
    biased = {"max_tokens": 6, "temperature": 0, "logit_bias": {"299": 100, "17": -100}}
    before = dispatched(setup.router_url, "disaggregated")
    got = router.completions.create(model=MODEL_NAME, prompt=prompt, **biased)
    want = httpx.post(f"{setup.oracle.url}/v1/completions", json={"prompt": prompt, **biased}, timeout=120).json()
    assert got.choices[0].text == want["choices"][0]["text"]
    assert dispatched(setup.router_url, "disaggregated") == before + 1
    likelihood = {"max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    routed = dispatched(setup.router_url, "needs_prompt")
    got = router.completions.create(model=MODEL_NAME, prompt=prompt, **likelihood).choices[0]
    want = httpx.post(f"{setup.oracle.url}/v1/completions", json={"prompt": prompt, **likelihood},
                      timeout=120).json()["choices"][0]
    assert got.logprobs.model_dump() == want["logprobs"] and got.finish_reason == "length"
    assert len(got.logprobs.token_logprobs) == len(prompt) and got.logprobs.token_logprobs[0] is None
    assert dispatched(setup.router_url, "needs_prompt") == routed + 1
    assert all_blocks_free(setup.prefill.url, setup.decode.url)


@pytest.mark.timeout(180)
def test_streamed_answer_through_router_equals_colocated(setup):
    prompt = _prompts(44, [2 * BLOCK + 9])[0]
    text = ""
    with httpx.stream("POST", f"{setup.router_url}/v1/completions", timeout=120,
                      json=body(prompt, stream=True, logprobs=None)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    oracle = httpx.post(f"{setup.oracle.url}/v1/completions", json=body(prompt, logprobs=None),
                        timeout=120).json()
    assert text == oracle["choices"][0]["text"]


@pytest.mark.timeout(300)
def test_hundred_concurrent_streams_complete_without_leaks(setup):
    prompts = _prompts(45, [3 + (i * 7) % 40 for i in range(100)])

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> tuple[bool, str]:
        payload = body(prompt, stream=True, logprobs=None)
        async with client.stream("POST", f"{setup.router_url}/v1/completions", json=payload) as response:
            events = [line async for line in response.aiter_lines() if line.startswith("data:")]
        return response.status_code == 200 and events[-1] == "data: [DONE]", "".join(events)

    async def run_all() -> list[tuple[bool, str]]:
        async with httpx.AsyncClient(timeout=240) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    failed = [events for ok, events in results if not ok or '"error"' in events]
    assert not failed, failed[:2]
    assert all_blocks_free(setup.prefill.url, setup.decode.url, timeout_s=20)


@pytest.mark.timeout(240)
def test_decode_killed_mid_request_client_gets_error_and_prefill_frees_at_expiry(model_dir, log_dir):
    prefill = InstanceProcess(model_dir, log_dir, **role_env("prefill", EXPIRY_S)).start()
    decode = InstanceProcess(model_dir, log_dir, **role_env("decode", EXPIRY_S)).start()
    try:
        prefill.wait_ready()
        decode.wait_ready()
        with running_router([(prefill.url, "prefill"), (decode.url, "decode")],
                            health_interval_s=30) as router:
            decode.send_signal(signal.SIGSTOP)  # the hand-over reaches a decode instance that hangs
            result: dict = {}

            def client() -> None:
                start = time.monotonic()
                response = httpx.post(f"{router.url}/v1/completions", timeout=120,
                                      json=body(_prompts(46, [3 * BLOCK + 2])[0]))
                result.update(status=response.status_code, seconds=time.monotonic() - start)

            thread = threading.Thread(target=client)
            thread.start()
            assert wait_for(lambda: blocks_held(prefill.url) == (4, 4), 30)  # pinned for decode
            decode.kill()
            thread.join(60)
            assert not thread.is_alive() and result["status"] >= 500  # an error, not a hang
            pinned_until = time.monotonic()
            assert wait_for(lambda: blocks_held(prefill.url) == (0, 0), EXPIRY_S + 5)
            assert time.monotonic() - pinned_until <= EXPIRY_S + 5
            assert scrape(prefill.url)["tandem:kv_transfer_failures_total{reason=expired}"] == 1
    finally:
        prefill.stop()
        decode.stop()


def _hand_over(prefill_url: str, prompt: list[int]) -> dict:
    reduced = body(prompt, max_tokens=1, logprobs=None, kv_transfer_params={"do_remote_decode": True})
    response = httpx.post(f"{prefill_url}/v1/completions", json=reduced, timeout=60, headers=KV_SECRET)
    assert response.status_code == 200, response.text
    return {**response.json()["kv_transfer_params"], "do_remote_prefill": True}


@pytest.mark.timeout(240)
def test_prefill_killed_decode_follows_its_failure_policy(model_dir, log_dir, oracle):
    prefill = InstanceProcess(model_dir, log_dir, **role_env("prefill", EXPIRY_S)).start()
    lenient = InstanceProcess(model_dir, log_dir, **role_env("decode", EXPIRY_S)).start()
    strict = InstanceProcess(model_dir, log_dir, **role_env(
        "decode", EXPIRY_S, TANDEM_DISAGGREGATION__KV_LOAD_FAILURE_POLICY="fail")).start()
    try:
        for proc in (prefill, lenient, strict):
            proc.wait_ready()
        prompt = _prompts(47, [2 * BLOCK + 5])[0]
        for decode in (lenient, strict):  # each learns the prefill's handshake and connects
            assert answer_tokens(decode.url, prompt, kv_transfer_params=_hand_over(prefill.url, prompt)) \
                == answer_tokens(oracle.url, prompt)
        pending = [_hand_over(prefill.url, prompt) for _ in range(2)]
        prefill.kill()
        recomputed = answer_tokens(lenient.url, prompt, kv_transfer_params=pending[0])
        assert recomputed == answer_tokens(oracle.url, prompt)
        failed = httpx.post(f"{strict.url}/v1/completions", timeout=60, headers=KV_SECRET,
                            json=body(prompt, kv_transfer_params=pending[1]))
        assert failed.status_code == 502 and failed.json()["error"]["code"] == "kv_transfer_failed"
        for decode in (lenient, strict):
            assert scrape(decode.url)["tandem:kv_transfer_failures_total{reason=peer}"] >= 1
        assert all_blocks_free(lenient.url, strict.url)
    finally:
        for proc in (prefill, lenient, strict):
            proc.stop()


@pytest.mark.timeout(180)
def test_compat_mismatch_through_router_is_a_clear_error(model_dir, log_dir, setup):
    other = InstanceProcess(model_dir, log_dir, **role_env("decode", EXPIRY_S, TANDEM_ENGINE__BLOCK_SIZE="8")).start()
    try:
        other.wait_ready()
        with running_router([(setup.prefill.url, "prefill"), (other.url, "decode")]) as router:
            response = httpx.post(f"{router.url}/v1/completions", json=body([5, 6, 7, 8]), timeout=60)
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "compat hash mismatch" in message and message.count("'") >= 4
        assert all_blocks_free(other.url)
    finally:
        other.stop()


@pytest.mark.timeout(180)
def test_structured_outputs_through_router_follow_the_grammar_and_equal_colocated(setup):
    """The prefill instance samples the first token under the same grammar as the decode
    instance, which takes the hand-over and goes on: the greedy answer is the colocated one."""
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tag": {"enum": ["a", "b", "c"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    prompt = _prompts(45, [2 * BLOCK + 5])[0]
    before = dispatched(setup.router_url, "disaggregated")
    for spec, check in [({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
                        ({"regex": r"[a-f]{3}\d{2}"}, lambda t: re.fullmatch(r"[a-f]{3}\d{2}", t))]:
        extra = {"structured_outputs": spec, "max_tokens": 100, "ignore_eos": False, "logprobs": None}
        routed = httpx.post(f"{setup.router_url}/v1/completions", json=body(prompt, **extra), timeout=120)
        direct = httpx.post(f"{setup.oracle.url}/v1/completions", json=body(prompt, **extra), timeout=120)
        assert routed.status_code == 200, routed.text
        text = routed.json()["choices"][0]["text"]
        assert check(text), text
        assert text == direct.json()["choices"][0]["text"]
    assert dispatched(setup.router_url, "disaggregated") - before == 2
    refused = httpx.post(f"{setup.router_url}/v1/completions", timeout=60,
                         json=body(prompt, structured_outputs={"regex": "(x"}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "structured_outputs"
    assert all_blocks_free(setup.prefill.url, setup.decode.url)
