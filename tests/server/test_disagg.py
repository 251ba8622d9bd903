"""The server half of disaggregated prefill/decode, with a prefill and a decode server in this
process joined by the loopback connector, driven over HTTP the way the router drives them. The
oracle is the shared colocated server on the same checkpoint: the decode server's greedy answer
must equal it token for token.
"""
from __future__ import annotations

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.router.instances import wait_for
from tests.server.server_helpers import running_server, scrape, server_config

MAX_TOKENS = 8
BLOCK = 16


def _role(model_dir, role: str, **overrides):
    return server_config(model_dir, served_model_name="tiny", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "loopback",
        "disaggregation.allow_insecure_no_secret": True, **overrides})


@pytest.fixture(scope="module")
def prefill(model_dir):
    with running_server(_role(model_dir, "prefill")) as srv:
        yield srv


@pytest.fixture(scope="module")
def decode(model_dir):
    with running_server(_role(model_dir, "decode")) as srv:
        yield srv


def body(prompt: list[int], **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, **extra}


def token_ids(answer: dict) -> list[str]:
    return answer["choices"][0]["logprobs"]["tokens"]


def hand_over(prefill_url: str, prompt: list[int]) -> dict:
    reduced = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    reduced.pop("logprobs")
    response = httpx.post(f"{prefill_url}/v1/completions", json=reduced, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


def decode_answer(decode_url: str, prompt: list[int], params: dict) -> httpx.Response:
    return httpx.post(f"{decode_url}/v1/completions", timeout=60,
                      json=body(prompt, kv_transfer_params={**params, "do_remote_prefill": True}))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("length", [5, BLOCK, 4 * BLOCK + 3])
def test_decode_answer_equals_colocated(server, prefill, decode, length):
    prompt = _prompts(20 + length, [length])[0]
    params = hand_over(prefill.url, prompt)
    assert set(params) == {"engine_id", "handshake_url", "transfer_id", "block_ids", "num_tokens",
                           "prompt_digest", "compat_hash", "expires_at", "kv_checksums"}
    assert params["num_tokens"] == length and len(params["block_ids"]) == -(-length // BLOCK)
    answer = decode_answer(decode.url, prompt, params)
    assert answer.status_code == 200, answer.text
    oracle = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60).json()
    assert token_ids(answer.json()) == token_ids(oracle)
    assert "kv_transfer_params" not in answer.json()


@pytest.mark.timeout(60)
def test_handshake_and_pins_are_released_after_the_read(prefill, decode):
    handshake = httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()
    assert handshake["connector"] == "loopback" and handshake["engine_id"]
    prompt = _prompts(30, [3 * BLOCK + 1])[0]
    params = hand_over(prefill.url, prompt)
    assert params["engine_id"] == handshake["engine_id"]
    assert scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 4
    before = scrape(decode.url)["tandem:kv_transfer_bytes_total"]
    assert decode_answer(decode.url, prompt, params).status_code == 200
    after = scrape(decode.url)
    block_bytes = handshake["block_bytes"]
    # 49 prompt tokens: the KV of positions 0..47 (3 blocks) is read, the last token computed here
    assert after["tandem:kv_transfer_bytes_total"] - before == 3 * block_bytes
    assert after["tandem:kv_transfer_seconds_count"] >= 1
    assert after["tandem:kv_blocks_used"] == 0
    assert wait_for(lambda: scrape(prefill.url)["tandem:kv_blocks_used"] == 0, 5)
    assert scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 0


@pytest.mark.timeout(120)
def test_compat_mismatch_is_a_clear_400(model_dir, prefill):
    prompt = _prompts(31, [20])[0]
    params = hand_over(prefill.url, prompt)
    with running_server(_role(model_dir, "decode", block_size=8)) as other:
        answer = decode_answer(other.url, prompt, params)
        local = other.engine._engine.kv_transfer.compat_hash
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert params["compat_hash"] in message and local in message


@pytest.mark.timeout(60)
def test_instances_serve_in_full_the_half_that_is_not_their_role(prefill, decode, server):
    prompt = [5, 6, 7]
    oracle = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=30).json()
    for url, half in [(decode.url, "do_remote_decode"), (server.url, "do_remote_decode"),
                      (server.url, "do_remote_prefill"), (prefill.url, "do_remote_prefill")]:
        answer = httpx.post(f"{url}/v1/completions", timeout=30,
                            json=body(prompt, kv_transfer_params={half: True}))
        assert answer.status_code == 200, answer.text
        assert "kv_transfer_params" not in answer.json()
        assert token_ids(answer.json()) == token_ids(oracle)
    neither = httpx.post(f"{decode.url}/v1/completions", timeout=30,
                         json=body(prompt, kv_transfer_params={"foo": 1}))
    assert neither.status_code == 400
    streamed = httpx.post(f"{prefill.url}/v1/completions", timeout=30,
                          json=body(prompt, stream=True, kv_transfer_params={"do_remote_decode": True}))
    assert streamed.status_code == 400
    assert httpx.get(f"{server.url}/kv/handshake", timeout=10).status_code == 404


@pytest.mark.timeout(120)
def test_unreachable_prefill_recomputes_or_fails_per_policy(model_dir, server, prefill, decode):
    prompt = _prompts(32, [2 * BLOCK + 5])[0]
    params = hand_over(prefill.url, prompt)
    gone = {**params, "engine_id": "gone", "handshake_url": "http://127.0.0.1:9/kv/handshake"}
    answer = decode_answer(decode.url, prompt, gone)
    oracle = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60).json()
    assert answer.status_code == 200 and token_ids(answer.json()) == token_ids(oracle)
    with running_server(_role(model_dir, "decode", kv_load_failure_policy="fail")) as strict:
        failed = decode_answer(strict.url, prompt, gone)
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "kv_transfer_failed"


@pytest.mark.timeout(60)
def test_chat_hand_over_equals_colocated(server, prefill, decode):
    chat = {"model": "tiny", "temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about paged attention, briefly."}]}
    reduced = {**chat, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(f"{prefill.url}/v1/chat/completions", json=reduced, timeout=30).json()
    params = params["kv_transfer_params"]
    before = scrape(decode.url)["tandem:kv_transfer_bytes_total"]
    answer = httpx.post(f"{decode.url}/v1/chat/completions", timeout=30,
                        json={**chat, "kv_transfer_params": {**params, "do_remote_prefill": True}})
    assert scrape(decode.url)["tandem:kv_transfer_bytes_total"] > before
    oracle = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"] == oracle.json()["choices"][0]["message"]
    assert answer.json()["usage"] == oracle.json()["usage"]


@pytest.mark.timeout(120)
def test_a_second_turn_reads_only_the_blocks_the_decode_instance_lacks(server, prefill, decode):
    """Multi-turn reuse: turn 2 repeats turn 1's 10 blocks and adds one block of new tokens.
    The decode instance matches turn 2 against its own prefix cache, which holds turn 1's
    blocks since its hand-over, so of the 11 blocks positions 0..174 need it reads 1 (1/11 of a
    cold hand-over's bytes); the prefill instance computes only the new tokens. The text equals
    a colocated run that has never seen turn 1."""
    turn1, new = _prompts(40, [10 * BLOCK, BLOCK])
    turn2 = turn1 + new
    block_bytes = httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()["block_bytes"]
    read = scrape(decode.url)["tandem:kv_transfer_bytes_total"]
    pinned = scrape(prefill.url)["tandem:kv_blocks_pending_release"]  # other tests' unread hand-overs
    assert decode_answer(decode.url, turn1, hand_over(prefill.url, turn1)).status_code == 200
    after_turn1 = scrape(decode.url)["tandem:kv_transfer_bytes_total"]
    assert after_turn1 - read == 10 * block_bytes  # positions 0..158: 10 blocks, none cached

    reduced = body(turn2, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    prefilled = httpx.post(f"{prefill.url}/v1/completions", json=reduced, timeout=60).json()
    assert prefilled["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK
    answer = decode_answer(decode.url, turn2, prefilled["kv_transfer_params"])
    assert answer.status_code == 200, answer.text
    assert scrape(decode.url)["tandem:kv_transfer_bytes_total"] - after_turn1 == block_bytes
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK

    cold = httpx.post(f"{server.url}/v1/completions", json=body(turn2), timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert token_ids(answer.json()) == token_ids(cold)

    # one token more than turn 1: positions 0..159 are all held here, nothing is read
    turn3 = turn1 + new[:1]
    answer = decode_answer(decode.url, turn3, hand_over(prefill.url, turn3))
    assert answer.status_code == 200, answer.text
    assert scrape(decode.url)["tandem:kv_transfer_bytes_total"] - after_turn1 == block_bytes
    cold = httpx.post(f"{server.url}/v1/completions", json=body(turn3), timeout=60).json()
    assert token_ids(answer.json()) == token_ids(cold)
    assert wait_for(lambda: scrape(prefill.url)["tandem:kv_blocks_pending_release"] <= pinned, 5)
    assert scrape(decode.url)["tandem:kv_blocks_used"] == 0
