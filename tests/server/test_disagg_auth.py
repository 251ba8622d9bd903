"""Authenticated hand-overs (issue 12, point 5): instances configured with
``disaggregation.kv_transfer_secret`` refuse ``kv_transfer_params``, ``/kv/handshake`` and
``/kv/release`` without the header ``X-Tandem-KV-Secret`` (401), and a refused request makes
the instance do nothing: it fetches no URL (a bait HTTP server must receive no request) and pins
no block. With the header, the hand-over works and its greedy answer equals the colocated one.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tandem.config import ConfigError
from tandem.server.app import create_app
from tests.engine.test_greedy_vs_hf import _prompts
from tests.server.handover_oracle import prompt_digest, signed
from tests.server.server_helpers import running_server, scrape, server_config

SECRET = "cluster-secret-for-the-tests-0123"
HEADER = "X-Tandem-KV-Secret"
MAX_TOKENS = 8


def _role(model_dir, role: str, secret: str | None = SECRET, **overrides):
    extra = {"disaggregation.kv_transfer_secret": secret} if secret is not None else {}
    return server_config(model_dir, served_model_name="tiny", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "loopback", **extra, **overrides})


@pytest.fixture(scope="module")
def prefill(model_dir):
    with running_server(_role(model_dir, "prefill")) as srv:
        yield srv


@pytest.fixture(scope="module")
def decode(model_dir):
    with running_server(_role(model_dir, "decode")) as srv:
        yield srv


class Bait:
    """An HTTP server that records every request it gets (and answers 200 with a handshake-like
    body, so that a fetch that should not happen would otherwise succeed)."""

    def __init__(self, host: str = "127.0.0.2") -> None:
        self.requests: list[str] = []
        bait = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 — http.server's name
                bait.requests.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"engine_id": "bait"}')

            def log_message(self, *args) -> None:
                pass

        try:
            self.server = ThreadingHTTPServer((host, 0), Handler)
        except OSError:  # no 127.0.0.2 here: another port of 127.0.0.1 stands for another host
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        host, port = self.server.server_address[:2]
        self.url = f"http://{host}:{port}/kv/handshake"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Bait:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def bait() -> Iterator[Bait]:
    with Bait() as server:
        yield server


def body(prompt: list[int], **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, **extra}


def forged_hand_over(decode, prompt: list[int], handshake_url: str) -> dict:
    """A decode-form ``kv_transfer_params`` that passes every check before the handshake fetch
    (the decode instance's own compat hash, the prompt's length and digest, a signature under
    the cluster secret, an expiry a minute away)."""
    return {"do_remote_prefill": True, **signed(SECRET, {
        "engine_id": "stranger", "transfer_id": "stranger/1", "block_ids": [1],
        "num_tokens": len(prompt), "prompt_digest": prompt_digest(SECRET, prompt),
        "compat_hash": decode.engine._engine.kv_transfer.compat_hash, "handshake_url": handshake_url,
        "expires_at": int(time.time()) + 60})}


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_kv_secret"
    assert HEADER in error["message"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("headers", [{}, {HEADER: "wrong-secret-of-the-same-size-012"}, {HEADER: ""}],
                         ids=["no header", "wrong secret", "empty header"])
def test_a_stranger_cannot_make_the_decode_instance_fetch_a_url(decode, bait, headers):
    prompt = [5, 6, 7, 8]
    params = forged_hand_over(decode, prompt, bait.url)
    response = httpx.post(f"{decode.url}/v1/completions", headers=headers, timeout=30,
                          json=body(prompt, kv_transfer_params=params))
    assert_401(response)
    time.sleep(0.2)  # a fetch started in the background would have arrived by now
    assert bait.requests == []


@pytest.mark.timeout(60)
def test_a_stranger_cannot_pin_blocks_on_the_prefill_instance(prefill):
    prompt = _prompts(60, [40])[0]
    for headers in ({}, {HEADER: SECRET[:-1] + "x"}):
        reduced = {**body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})}
        response = httpx.post(f"{prefill.url}/v1/completions", headers=headers, json=reduced, timeout=30)
        assert_401(response)
    for _ in range(10):  # stays 0: nothing was pinned, nothing waits for an expiry
        assert scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 0
        assert scrape(prefill.url)["tandem:kv_blocks_used"] == 0
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_the_handshake_needs_the_secret(prefill):
    for headers in ({}, {HEADER: "x" * len(SECRET)}):
        assert_401(httpx.get(f"{prefill.url}/kv/handshake", headers=headers, timeout=10))
    handshake = httpx.get(f"{prefill.url}/kv/handshake", headers={HEADER: SECRET}, timeout=10)
    assert handshake.status_code == 200 and handshake.json()["connector"] == "loopback"


def hand_over(prefill_url: str, prompt: list[int]) -> dict:
    reduced = body(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    reduced.pop("logprobs")
    response = httpx.post(f"{prefill_url}/v1/completions", json=reduced, headers={HEADER: SECRET}, timeout=60)
    assert response.status_code == 200, response.text
    return {**response.json()["kv_transfer_params"], "do_remote_prefill": True}


@pytest.mark.timeout(120)
def test_with_the_secret_the_hand_over_works_and_equals_colocated(server, prefill, decode):
    prompt = _prompts(61, [3 * 16 + 5])[0]
    params = hand_over(prefill.url, prompt)
    assert params["prompt_digest"] == prompt_digest(SECRET, prompt)
    before = scrape(decode.url)["tandem:kv_transfer_bytes_total"]
    answer = httpx.post(f"{decode.url}/v1/completions", json=body(prompt, kv_transfer_params=params),
                        headers={HEADER: SECRET}, timeout=60)
    assert answer.status_code == 200, answer.text
    # the decode instance fetched the handshake with the secret and read the blocks over it
    assert scrape(decode.url)["tandem:kv_transfer_bytes_total"] > before
    oracle = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60).json()
    tokens = answer.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == oracle["choices"][0]["logprobs"]["tokens"]


@pytest.mark.timeout(60)
def test_kv_release_needs_the_secret_and_frees_the_pin_once(prefill):
    params = hand_over(prefill.url, _prompts(62, [2 * 16 + 1])[0])
    assert scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 3
    release = {"transfer_id": params["transfer_id"]}
    assert_401(httpx.post(f"{prefill.url}/kv/release", json=release, timeout=10))
    assert scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 3
    first = httpx.post(f"{prefill.url}/kv/release", json=release, headers={HEADER: SECRET}, timeout=10)
    assert first.status_code == 200 and first.json() == {**release, "released": True}
    assert scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 0
    assert scrape(prefill.url)["tandem:kv_blocks_used"] == 0
    again = httpx.post(f"{prefill.url}/kv/release", json=release, headers={HEADER: SECRET}, timeout=10)
    assert again.status_code == 200 and again.json()["released"] is False
    bad = httpx.post(f"{prefill.url}/kv/release", json={**release, "extra": 1}, headers={HEADER: SECRET},
                     timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "extra"


@pytest.mark.timeout(60)
def test_a_colocated_instance_has_nothing_to_release(server):
    answer = httpx.post(f"{server.url}/kv/release", json={"transfer_id": "x/y"}, timeout=10)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_disaggregated_instance_without_secret_refuses_to_start_unless_told_it_is_insecure(
        model_dir, caplog, role):
    with pytest.raises(ConfigError) as refused:
        create_app(_role(model_dir, role, secret=None))
    for part in ("disaggregation.kv_transfer_secret", "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET",
                 "tandem serve --disaggregated", "allow_insecure_no_secret"):
        assert part in str(refused.value)
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        create_app(_role(model_dir, role, secret=None, **{"disaggregation.allow_insecure_no_secret": True}))
    warnings = [r.getMessage() for r in caplog.records if "kv_transfer_secret is unset" in r.getMessage()]
    assert warnings and "anyone who can reach this instance can drive its KV hand-overs" in warnings[0]
    create_app(_role(model_dir, "both", secret=None))  # a colocated instance needs none


GOOD_DECODE_FORM = {"do_remote_prefill": True, "engine_id": "e", "transfer_id": "e/1", "block_ids": [1],
                    "num_tokens": 4, "prompt_digest": "0" * 64, "compat_hash": "c",
                    "handshake_url": "http://127.0.0.1:9/kv/handshake", "expires_at": 2**40}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("params, named", [
    ({"do_remote_decode": True, "remote_engine_id": "x"}, "kv_transfer_params.remote_engine_id"),
    ({**GOOD_DECODE_FORM, "block_ids": [1, "2"]}, "kv_transfer_params.block_ids.1"),
    ({**GOOD_DECODE_FORM, "block_ids": [-1]}, "kv_transfer_params.block_ids.0"),
    ({**GOOD_DECODE_FORM, "num_tokens": 0}, "kv_transfer_params.num_tokens"),
    ({**GOOD_DECODE_FORM, "num_tokens": "4"}, "kv_transfer_params.num_tokens"),
    ({**GOOD_DECODE_FORM, "prompt_digest": "not hex"}, "kv_transfer_params.prompt_digest"),
    ({**GOOD_DECODE_FORM, "handshake_url": "file:///etc/passwd"}, "kv_transfer_params.handshake_url"),
    ({**GOOD_DECODE_FORM, "handshake_url": "gopher://127.0.0.1:70/"}, "kv_transfer_params.handshake_url"),
    ({**GOOD_DECODE_FORM, "engine_id": 7}, "kv_transfer_params.engine_id"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"do_remote_decode": True, "engine_id": "x"}, "do_remote_decode takes no other field (got engine_id)"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "set exactly one of"),
    ({"do_remote_prefill": False}, "set exactly one of"),
    ({k: v for k, v in GOOD_DECODE_FORM.items() if k not in ("prompt_digest", "block_ids")},
     "do_remote_prefill needs kv_transfer_params.block_ids, kv_transfer_params.prompt_digest"),
])
def test_malformed_kv_transfer_params_are_a_400_naming_the_field(decode, bait, params, named):
    if params.get("handshake_url") == GOOD_DECODE_FORM["handshake_url"]:
        params = {**params, "handshake_url": bait.url}
    response = httpx.post(f"{decode.url}/v1/completions", headers={HEADER: SECRET}, timeout=30,
                          json=body([5, 6, 7, 8], kv_transfer_params=params))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "kv_transfer_params" and named in error["message"]
    assert bait.requests == []


@pytest.mark.timeout(60)
def test_an_oversized_handshake_is_a_load_failure(model_dir, server, decode):
    prompt = [5, 6, 7, 8, 9, 10]
    with Bait() as big:
        big_url = big.url
        big.server.RequestHandlerClass.do_GET = _oversized_answer
        params = forged_hand_over(decode, prompt, big_url)
        lenient = httpx.post(f"{decode.url}/v1/completions", headers={HEADER: SECRET}, timeout=30,
                             json=body(prompt, kv_transfer_params=params))
        with running_server(_role(model_dir, "decode", kv_load_failure_policy="fail")) as strict:
            params = forged_hand_over(strict, prompt, big_url)
            failed = httpx.post(f"{strict.url}/v1/completions", headers={HEADER: SECRET}, timeout=30,
                                json=body(prompt, kv_transfer_params=params))
    oracle = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60).json()
    assert lenient.status_code == 200  # recomputed here
    assert lenient.json()["choices"][0]["text"] == oracle["choices"][0]["text"]
    assert failed.status_code == 502 and failed.json()["error"]["code"] == "kv_transfer_failed"
    assert f"more than {1 << 20} bytes" in failed.json()["error"]["message"]
    assert "stranger" not in decode.app.state.tandem.handshakes


def _oversized_answer(handler) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.end_headers()
    try:
        for _ in range(64):  # 4 MiB, in 64 KiB writes: the reader must stop well before the end
            handler.wfile.write(b" " * (64 << 10))
    except (BrokenPipeError, ConnectionResetError):
        pass


def test_reset_prefix_cache_needs_the_secret_and_forgets_the_cached_blocks(model_dir):
    """POST /reset_prefix_cache: 403 on an instance without a secret, 401 without the header;
    with it, the prompt's full blocks are forgotten (3 for 50 tokens, by hand) and a repeat
    of the prompt finds nothing in the cache (/metrics' hit counter, the oracle)."""
    with running_server(server_config(model_dir, served_model_name="tiny")) as open_instance:
        refused = httpx.post(f"{open_instance.url}/reset_prefix_cache", timeout=10)
        assert refused.status_code == 403 and "kv_transfer_secret" in refused.json()["error"]["message"]
    with running_server(server_config(model_dir, served_model_name="tiny", **{
            "disaggregation.kv_transfer_secret": SECRET})) as srv:
        prompt = _prompts(90, [3 * 16 + 2])[0]

        def ask() -> float:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
            assert httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).status_code == 200
            return scrape(srv.url)["tandem:prefix_cache_hits_total"]

        cold = ask()
        warm = ask()
        assert warm - cold == 3 * 16
        assert httpx.post(f"{srv.url}/reset_prefix_cache", timeout=10).status_code == 401
        reset = httpx.post(f"{srv.url}/reset_prefix_cache", headers={HEADER: SECRET}, timeout=10)
        assert reset.status_code == 200 and reset.json() == {"num_blocks_forgotten": 3}
        assert ask() == warm  # no hit after the reset
