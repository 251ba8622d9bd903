"""The router is safe by default (issue 24, points 1, 2 and 3), against a real decode instance
(``tandem serve --role decode`` with the cluster secret) and the real router app under uvicorn:
the admin API is off without its key, /health tells an anonymous caller only ready or not, a
model id cannot climb out of /v1/models (requests sent byte for byte over a socket, as no client
library would normalise them), a client's own kv_transfer_params never reach an instance, and no
key or secret shows in an answer or a log. Frozen instances are recording stand-ins under
uvicorn that take a request and go silent: the router fails over, or answers 504, within its
read timeout, which is per read (a slow stream whose chunks keep coming is not cut)."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from tests.router.fakes import FakeInstance, completion, event, json_reply
from tests.router.instances import (
    ADMIN,
    ADMIN_KEY,
    CLUSTER_SECRET,
    MODEL_NAME,
    InstanceProcess,
    free_port,
    role_env,
    running_router,
)
from tests.server.server_helpers import ServerThread

pytest.importorskip("nixl_cu12", reason="a decode instance needs the nixl KV connector (nixl-cu12)")

API_KEY = "client-api-key-of-the-security-tests"
BODY = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 4, "temperature": 0}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def decode(model_dir, log_dir):
    proc = InstanceProcess(model_dir, log_dir, **role_env("decode", 60.0), TANDEM_SERVER__API_KEY=API_KEY).start()
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def router(decode):
    with running_router([(decode.url, "decode")], api_key=API_KEY) as server:
        yield server


def raw_request(url: str, target: str, method: str = "GET") -> tuple[int, bytes]:
    """``method target`` sent as these bytes (no client normalises the path); status and body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


@pytest.mark.parametrize("target", [
    "/v1/models/%2e%2e/%2e%2e/metrics",
    "/v1/models/%2E%2E/%2E%2E/metrics",
    "/v1/models/../../metrics",
    "/v1/models/..%2F..%2Fmetrics",
    "/v1/models/%2e%2e%2f%2e%2e%2fmetrics",
    "/v1/models/tiny/../../../metrics",
    "/v1/models/%252e%252e/%252e%252e/metrics",
    "/v1/models/..%5c..%5cmetrics",
    "/v1/models/./../metrics",
    "/v1/models/%2e%2e/%2e%2e/kv/handshake",
    "/v1/models/a//b",
])
def test_a_model_id_that_could_name_another_route_is_a_400(router, target):
    status, body = raw_request(router.url, target)
    assert status == 400, body
    assert b"invalid_model_id" in body and b"tandem:" not in body and b"engine_id" not in body


def test_legal_model_ids_still_reach_the_instance(router):
    status, body = raw_request(router.url, f"/v1/models/{MODEL_NAME}")
    assert status == 200 and httpx.Response(200, content=body).json()["id"] == MODEL_NAME
    status, body = raw_request(router.url, "/v1/models/org/Llama-3.1-8B")  # a Hugging Face id: legal
    assert status == 404 and b"model_not_found" in body  # the instance's answer: it serves another


@pytest.mark.parametrize("method, target", [
    ("GET", "/kv/handshake"), ("POST", "/kv/release"), ("GET", "/v1/kv/handshake"), ("GET", "/v1/metrics"),
    ("GET", "/v1/../kv/handshake"), ("GET", "/v1/%2e%2e/kv/handshake"),
])
def test_only_the_public_routes_are_relayed(router, method, target):
    status, body = raw_request(router.url, target, method)
    assert status in (404, 405), body
    assert b"engine_id" not in body and b"tandem:num_requests" not in body


def test_a_clients_own_kv_transfer_params_never_reach_the_instance(router, decode):
    canary = FakeInstance(json_reply({}))
    forged = {"do_remote_prefill": True, "engine_id": "forged", "transfer_id": "forged/1", "block_ids": [1, 2],
              "num_tokens": 6, "prompt_digest": "0" * 64, "compat_hash": "x",
              "handshake_url": f"{canary.url}/kv/handshake"}
    with canary:
        refused = httpx.post(f"{decode.url}/v1/completions", json={**BODY, "kv_transfer_params": forged},
                             headers=AUTH, timeout=60)
        assert refused.status_code == 401  # what the instance does with them: the router must strip them
        want = httpx.post(f"{decode.url}/v1/completions", json=BODY, headers=AUTH, timeout=60).json()
        got = httpx.post(f"{router.url}/v1/completions", json={**BODY, "kv_transfer_params": forged},
                         headers=AUTH, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want["choices"][0]["text"]
        assert canary.bodies == []
        assert "kv_transfer_params" not in got.json()


def test_the_admin_api_is_off_by_default_and_health_names_no_instance(decode):
    attacker = FakeInstance(json_reply(completion("the attacker's")))
    with attacker, running_router([(decode.url, "decode")], api_key=API_KEY, router_admin_key=None) as router:
        added = httpx.post(f"{router.url}/admin/instances", json={"url": attacker.url, "role": "decode"}, timeout=10)
        removed = httpx.delete(f"{router.url}/admin/instances", params={"url": decode.url}, timeout=10)
        listed = httpx.get(f"{router.url}/admin/instances", timeout=10)
        for answer in (added, removed, listed):
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_api_disabled"
        for _ in range(3):  # the decode instance still serves every request, the attacker none
            assert httpx.post(f"{router.url}/v1/completions", json=BODY, headers=AUTH, timeout=60).status_code == 200
        assert attacker.bodies == []
        health = httpx.get(f"{router.url}/health", timeout=10, headers=ADMIN)  # no key here: no details
        assert health.json() == {"status": "ok"}


def test_health_lists_the_instances_only_to_the_admin(router, decode):
    anonymous = httpx.get(f"{router.url}/health", timeout=10)
    assert (anonymous.status_code, anonymous.json()) == (200, {"status": "ok"})
    wrong = httpx.get(f"{router.url}/health", timeout=10, headers={"Authorization": "Bearer nope"})
    assert wrong.json() == {"status": "ok"}
    admin = httpx.get(f"{router.url}/health", timeout=10, headers=ADMIN).json()
    assert [(i["url"], i["healthy"]) for i in admin["instances"]] == [(decode.url, True)]
    with running_router([("http://127.0.0.1:9", "decode")]) as down:
        answer = httpx.get(f"{down.url}/health", timeout=10)
        assert (answer.status_code, answer.json()) == (503, {"status": "not_ready"})
        assert "127.0.0.1:9" not in answer.text


def test_no_key_or_secret_shows_in_answers_or_logs(router, decode, caplog):
    answers = []
    with caplog.at_level(logging.DEBUG):
        answers.append(httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30,
                                  headers={"Authorization": "Bearer wrong"}))
        answers.append(httpx.post(f"{router.url}/admin/instances", json={"url": "http://x:1", "role": "x"},
                                  timeout=30, headers={"Authorization": "Bearer wrong"}))
        answers.append(httpx.post(f"{router.url}/v1/completions", json={**BODY, "max_tokens": -1},
                                  headers=AUTH, timeout=30))
        answers.append(httpx.get(f"{router.url}/health", headers=ADMIN, timeout=30))
        answers.append(httpx.get(f"{decode.url}/kv/handshake", timeout=30, headers={"X-Tandem-KV-Secret": "wrong"}))
    seen = caplog.text + "".join(a.text for a in answers) + decode.log_path.read_text()
    assert [a.status_code for a in answers] == [401, 401, 400, 200, 401]
    for value in (API_KEY, ADMIN_KEY, CLUSTER_SECRET):
        assert value not in seen


def test_an_instance_of_role_prefill_or_decode_without_the_secret_refuses_to_start(model_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    for role in ("prefill", "decode"):
        result = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "serve", str(model_dir), "--role", role, "--port", str(free_port())],
            capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2, result.stderr[-2000:]
        for part in ("disaggregation.kv_transfer_secret", "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET",
                     "tandem serve --disaggregated", "allow_insecure_no_secret"):
            assert part in result.stderr


# --------------------------------------------------------------------------- frozen instances

TIMEOUT_S = 1.0


class SilentInstance:
    """Healthy to health checks; a POST to /v1 gets ``chunks`` SSE events ``gap_s`` apart (none:
    no answer at all) and then nothing until the test ends: a frozen instance, as the router sees
    it. ``requests`` counts the POSTs."""

    def __init__(self, chunks: int = 0, gap_s: float = 0.0, then_done: bool = False) -> None:
        self.requests = 0
        self.released = threading.Event()
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ready"}

        @app.post("/v1/completions")
        async def generate(request: Request) -> StreamingResponse:
            self.requests += 1
            while chunks == 0 and not self.released.is_set():
                await asyncio.sleep(0.05)

            async def body():
                for index in range(chunks):
                    yield event({"choices": [{"index": 0, "text": f"t{index}", "finish_reason": None}]})
                    await asyncio.sleep(gap_s)
                if then_done:
                    yield event("[DONE]")
                    return
                while not self.released.is_set():
                    await asyncio.sleep(0.05)

            return StreamingResponse(body(), media_type="text/event-stream")

        self.server = ServerThread(app)
        self.url = self.server.url

    def __enter__(self) -> SilentInstance:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self.server.stop()


def timed(call) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    answer = call()
    return answer, time.monotonic() - start


def test_a_frozen_instance_alone_is_a_504_within_the_read_timeout():
    with SilentInstance() as frozen, running_router([(frozen.url, "decode")], upstream_timeout_s=TIMEOUT_S) as router:
        answer, elapsed = timed(lambda: httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30))
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "upstream_timeout"
        assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3
        assert frozen.requests == 1


def test_a_frozen_instance_fails_over_to_the_next_one():
    with SilentInstance() as frozen, FakeInstance(json_reply(completion("decoded"))) as good, \
            running_router([(frozen.url, "decode"), (good.url, "decode")], decode_routing_policy="round_robin",
                           upstream_timeout_s=TIMEOUT_S, health_interval_s=30) as router:
        for _ in range(2):
            answer, elapsed = timed(lambda: httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=30))
            assert (answer.status_code, answer.json()) == (200, completion("decoded"))
            assert elapsed < TIMEOUT_S + 3
        assert frozen.requests == 1 and len(good.bodies) == 2  # taken out of rotation once it froze


def test_a_stream_that_freezes_between_chunks_ends_with_a_timeout_event():
    with SilentInstance(chunks=2) as frozen, \
            running_router([(frozen.url, "decode")], upstream_timeout_s=TIMEOUT_S) as router:
        start = time.monotonic()
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**BODY, "stream": True}, timeout=30) as answer:
            events = [line for line in answer.iter_lines() if line.startswith("data: ")]
        assert time.monotonic() - start < TIMEOUT_S + 3
        assert events[:2] == [event({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}).strip()
                              for i in range(2)]
        assert '"upstream_timeout"' in events[2] and events[3] == "data: [DONE]"


def test_the_read_timeout_is_per_read_not_for_the_whole_stream():
    chunks, gap_s = 6, TIMEOUT_S / 2  # three times the timeout in all, half of it between two chunks
    with SilentInstance(chunks=chunks, gap_s=gap_s, then_done=True) as slow, \
            running_router([(slow.url, "decode")], upstream_timeout_s=TIMEOUT_S) as router:
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**BODY, "stream": True}, timeout=30) as answer:
            events = [line for line in answer.iter_lines() if line.startswith("data: ")]
        assert len(events) == chunks + 1 and events[-1] == "data: [DONE]"
        assert not any("error" in e for e in events)
