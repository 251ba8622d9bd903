"""Signed hand-overs (issue 24, point 2), against a prefill and a decode server sharing a cluster
secret, joined by the loopback connector. The requests are sent with the cluster's header, as the
router relays them, so only the hand-over's own signature stands between a forger and the
prefill instance's blocks. Oracles: the MACs recomputed with Python's ``hmac`` from their written
definition (``tests.server.handover_oracle``), the KV byte counters of both instances (a refused
hand-over reads nothing and leaves the victim's pin in place), and the colocated server's greedy
answer.
"""
from __future__ import annotations

import hashlib
import json
import time
from array import array

import httpx
import pytest

from tandem.server.disagg import HANDSHAKE_MAX_BYTES
from tests.engine.test_greedy_vs_hf import _prompts
from tests.server.handover_oracle import prompt_digest, signature, signed
from tests.server.server_helpers import scrape
from tests.server.test_disagg_auth import (  # noqa: F401  (fixtures: prefill and decode, with the secret)
    HEADER,
    SECRET,
    Bait,
    body,
    decode,
    hand_over,
    prefill,
)

BLOCK = 16


@pytest.fixture(scope="module")
def victim(prefill) -> tuple[list[int], dict]:
    """Another user's prompt, prefilled: its blocks stay pinned on the prefill instance."""
    prompt = _prompts(90, [3 * BLOCK + 5])[0]
    return prompt, hand_over(prefill.url, prompt)


def decode_with(decode, prompt: list[int], params: dict, **extra) -> httpx.Response:
    return httpx.post(f"{decode.url}/v1/completions", headers={HEADER: SECRET}, timeout=60,
                      json=body(prompt, kv_transfer_params=params, **extra))


def kv_counters(prefill, decode) -> tuple[float, float]:
    """(bytes the decode instance read, blocks the prefill instance keeps pinned)."""
    return (scrape(decode.url)["tandem:kv_transfer_bytes_total"],
            scrape(prefill.url)["tandem:kv_blocks_pending_release"])


def colocated_text(server, prompt: list[int]) -> str:
    answer = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60)
    return answer.json()["choices"][0]["text"]


@pytest.mark.timeout(60)
def test_the_prefill_instance_signs_its_hand_over_as_documented(prefill):
    prompt = _prompts(91, [2 * BLOCK + 3])[0]
    before = time.time()
    params = hand_over(prefill.url, prompt)
    assert params["prompt_digest"] == prompt_digest(SECRET, prompt)
    assert params["signature"] == signature(SECRET, params)
    expiry_s = prefill.engine._engine.config.disaggregation.kv_expiry_s
    assert before + expiry_s - 1 <= params["expires_at"] <= time.time() + expiry_s
    assert params["handshake_url"] == f"{prefill.url}/kv/handshake"


@pytest.mark.timeout(60)
def test_the_forgery_of_issue_24_reads_nothing(prefill, decode, victim):
    """The attack as filed: a hand-over naming the victim's blocks, with the unkeyed digest of
    the forger's own prompt, lands those blocks in the forger's request and prefix cache."""
    prompt, genuine = victim
    forger_prompt = _prompts(92, [len(prompt)])[0]
    forged = {key: genuine[key] for key in ("engine_id", "block_ids", "num_tokens", "compat_hash",
                                            "handshake_url")}
    unkeyed = hashlib.blake2b(array("q", forger_prompt).tobytes(), digest_size=16).hexdigest()
    forged |= {"do_remote_prefill": True, "transfer_id": "forger/1", "prompt_digest": unkeyed}
    before = kv_counters(prefill, decode)
    answer = decode_with(decode, forger_prompt, forged)
    assert answer.status_code == 400, answer.text
    assert kv_counters(prefill, decode) == before


def _tampered(genuine: dict, bait_url: str) -> dict[str, dict]:
    other_secret = "another-cluster-secret-0123456789"
    unsigned = {k: v for k, v in genuine.items() if k != "signature"}
    return {
        "unsigned": unsigned,
        "signed under another secret": signed(other_secret, unsigned),
        "a block id changed": {**genuine, "block_ids": [genuine["block_ids"][0] + 1,
                                                         *genuine["block_ids"][1:]]},
        "a block dropped": {**genuine, "block_ids": genuine["block_ids"][:-1]},
        "another engine id": {**genuine, "engine_id": "stranger"},
        "redirected": {**genuine, "handshake_url": bait_url},
        "another transfer id": {**genuine, "transfer_id": genuine["engine_id"] + "/other"},
        "a later expiry": {**genuine, "expires_at": genuine["expires_at"] + 3600},
        "a forged signature": {**genuine, "signature": "0" * 64},
    }


@pytest.mark.timeout(120)
def test_an_altered_hand_over_is_refused_before_any_fetch_or_read(prefill, decode, victim):
    prompt, genuine = victim
    before = kv_counters(prefill, decode)
    with Bait() as bait:
        for name, params in _tampered(genuine, bait.url).items():
            answer = decode_with(decode, prompt, params)
            assert answer.status_code == 400, (name, answer.text)
            error = answer.json()["error"]
            assert (error["code"], error["param"]) == ("invalid_kv_signature", "kv_transfer_params"), name
            assert kv_counters(prefill, decode) == before, name
        assert bait.requests == []


@pytest.mark.timeout(120)
def test_the_genuine_hand_over_is_still_read_afterwards(server, prefill, decode, victim):
    prompt, genuine = victim
    read_before, pinned_before = kv_counters(prefill, decode)
    answer = decode_with(decode, prompt, genuine)
    assert answer.status_code == 200, answer.text
    block_bytes = decode.engine._engine.kv_transfer.block_bytes
    # 53 prompt tokens: positions 0..51 (4 blocks) are read, the last token is computed here
    assert scrape(decode.url)["tandem:kv_transfer_bytes_total"] - read_before == 4 * block_bytes
    assert pinned_before >= 4
    assert answer.json()["choices"][0]["text"] == colocated_text(server, prompt)


@pytest.mark.timeout(120)
def test_an_expired_hand_over_is_computed_here_and_not_read(server, prefill, decode):
    prompt = _prompts(93, [2 * BLOCK + 7])[0]
    genuine = hand_over(prefill.url, prompt)
    before = kv_counters(prefill, decode)
    expired = signed(SECRET, {**genuine, "expires_at": int(time.time()) - 1})
    answer = decode_with(decode, prompt, expired)
    assert answer.status_code == 200, answer.text
    assert kv_counters(prefill, decode) == before
    assert answer.json()["choices"][0]["text"] == colocated_text(server, prompt)
    # the same hand-over, re-signed by the test with a later expiry, is believed and read
    renewed = signed(SECRET, {**genuine, "expires_at": int(time.time()) + 60})
    assert decode_with(decode, prompt, renewed).status_code == 200
    assert kv_counters(prefill, decode)[0] > before[0]


def _answering(payload: bytes):
    def do_get(handler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)
    return do_get


def _pointing_at(genuine: dict, url: str, engine_id: str) -> dict:
    """``genuine`` made to name another engine and handshake URL, signed with the secret (as a
    prefill instance that holds it, and answers a hostile handshake, would sign it)."""
    return signed(SECRET, {**genuine, "engine_id": engine_id, "handshake_url": url})


@pytest.mark.timeout(120)
def test_a_handshake_of_a_mebibyte_of_brackets_is_a_load_failure(server, prefill, decode):
    prompt = _prompts(94, [BLOCK + 3])[0]
    genuine = hand_over(prefill.url, prompt)
    with Bait() as brackets:
        brackets.server.RequestHandlerClass.do_GET = _answering(b"[" * HANDSHAKE_MAX_BYTES)
        answer = decode_with(decode, prompt, _pointing_at(genuine, brackets.url, "brackets"))
    assert answer.status_code == 200, answer.text  # computed here, as for any handshake failure
    assert answer.json()["choices"][0]["text"] == colocated_text(server, prompt)
    assert "brackets" not in decode.app.state.tandem.handshakes


@pytest.mark.timeout(120)
def test_a_handshake_claiming_2_31_blocks_is_refused_before_anything_is_read(prefill, decode):
    prompt = _prompts(95, [2 * BLOCK + 1])[0]
    genuine = hand_over(prefill.url, prompt)
    real = httpx.get(f"{prefill.url}/kv/handshake", headers={HEADER: SECRET}, timeout=10).json()
    huge = {**real, "engine_id": "huge", "num_blocks": 2**31}
    before = kv_counters(prefill, decode)
    with Bait() as liar:
        liar.server.RequestHandlerClass.do_GET = _answering(json.dumps(huge).encode())
        answer = decode_with(decode, prompt, _pointing_at(genuine, liar.url, "huge"))
    assert answer.status_code == 400, answer.text
    assert str(2**31) in answer.json()["error"]["message"]
    assert kv_counters(prefill, decode) == before
    assert decode_with(decode, prompt, genuine).status_code == 200  # the real one still reads
    assert kv_counters(prefill, decode)[0] > before[0]


def salted_hand_over(prefill, prompt: list[int], salt: str) -> dict:
    reduced = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}, cache_salt=salt)
    response = httpx.post(f"{prefill.url}/v1/completions", json=reduced, headers={HEADER: SECRET}, timeout=60)
    assert response.status_code == 200, response.text
    return {**response.json()["kv_transfer_params"], "do_remote_prefill": True}


def cached_tokens(instance, prompt: list[int], salt: str) -> int:
    answer = httpx.post(f"{instance.url}/v1/completions", timeout=60,
                        json={**body(prompt, max_tokens=1), "cache_salt": salt})
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.timeout(120)
def test_the_cache_salt_travels_in_the_signed_digest(server, prefill, decode):
    """KV prefilled under one tenant's salt is read only by a request of that salt, and lands in
    the decode instance's prefix cache under it."""
    prompt = _prompts(96, [3 * BLOCK + 5])[0]
    first = salted_hand_over(prefill, prompt, "tenant-1")
    # the request's salt as the engine keys it: the client's, and no rope variant for this model
    assert first["prompt_digest"] == prompt_digest(SECRET, prompt, json.dumps(["tenant-1", None]))
    assert first["prompt_digest"] != prompt_digest(SECRET, prompt)
    before = kv_counters(prefill, decode)
    other_tenant = decode_with(decode, prompt, first, cache_salt="tenant-2")
    assert other_tenant.status_code == 200, other_tenant.text  # recomputed here, nothing read
    assert kv_counters(prefill, decode)[0] == before[0]
    assert other_tenant.json()["choices"][0]["text"] == colocated_text(server, prompt)
    second = salted_hand_over(prefill, prompt, "tenant-1")
    same_tenant = decode_with(decode, prompt, second, cache_salt="tenant-1")
    assert same_tenant.status_code == 200 and kv_counters(prefill, decode)[0] > before[0]
    assert same_tenant.json()["choices"][0]["text"] == colocated_text(server, prompt)
    assert cached_tokens(decode, prompt, "tenant-1") == 3 * BLOCK
    assert cached_tokens(decode, prompt, "tenant-3") == 0
