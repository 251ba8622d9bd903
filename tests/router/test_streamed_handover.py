"""Streamed hand-overs (``disaggregation.stream_kv``) end to end: a prefill ``tandem serve``
subprocess that answers at admission and announces its blocks chunk by chunk
(``--max-num-batched-tokens 1``: 16 steps per block), a decode subprocess reading them over
real NIXL/UCX (TCP) as they are announced, the router in this process, and a colocated instance
as the oracle — greedy answers must equal its answers token for token. Faults stop and kill the
prefill instance mid-stream; blocks are counted through /metrics.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.router.instances import (
    CLUSTER_SECRET,
    KV_SECRET,
    InstanceProcess,
    dispatched,
    role_env,
    running_router,
    scrape,
    wait_for,
)
from tests.router.test_disaggregated_flow import answer_tokens, body
from tests.server.handover_oracle import SIGNED_FIELDS, prompt_digest

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")

BLOCK = 16
FLAGS = ("--num-kv-blocks", "160", "--max-num-batched-tokens", str(BLOCK))
PREFILL_FLAGS = ("--num-kv-blocks", "160", "--max-num-batched-tokens", "1")
"""One token per step: the prefill of a 25-block prompt (400 steps) outlasts the decode
instance's set-up (handshake, admission), and a fault test stops it well before its end."""
TCP = {"UCX_TLS": "tcp"}
STOPPED_TOKENS = 29 * BLOCK + 3
"""The prompt whose prefill a fault test stops (the tiny Llama takes 512 positions)."""
KILL_GRACE_S = 1.5
"""How long a frozen prefill instance is left alive before it is killed (stopped_mid_stream)."""


@dataclass
class Cluster:
    oracle: InstanceProcess
    prefill: InstanceProcess
    decode: InstanceProcess
    strict: InstanceProcess
    """A decode instance with kv_load_failure_policy "fail" (the router does not know it)."""
    router_url: str


@pytest.fixture(scope="module")
def cluster(model_dir, log_dir) -> Iterator[Cluster]:
    stream = {"TANDEM_DISAGGREGATION__STREAM_KV": "true"}
    procs = [InstanceProcess(model_dir, log_dir, flags=FLAGS),
             InstanceProcess(model_dir, log_dir, flags=PREFILL_FLAGS, **role_env("prefill", 5.0, **TCP, **stream)),
             InstanceProcess(model_dir, log_dir, flags=FLAGS, **role_env("decode", 5.0, **TCP)),
             InstanceProcess(model_dir, log_dir, flags=FLAGS, **role_env(
                 "decode", 5.0, **TCP, TANDEM_DISAGGREGATION__KV_LOAD_FAILURE_POLICY="fail"))]
    try:
        for proc in procs:
            proc.start()
        oracle, prefill, decode, strict = (proc.wait_ready() for proc in procs)
        with running_router([(prefill.url, "prefill"), (decode.url, "decode")]) as router:
            yield Cluster(oracle, prefill, decode, strict, router.url)
    finally:
        for proc in procs:
            proc.stop()


def until_read(decode_url: str, reads: float, timeout_s: float = 30.0) -> bool:
    """Until the decode instance posted a read after ``reads`` (asked without pause: the
    prefill instance must be stopped long before its prompt is done)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if scrape(decode_url)["tandem:kv_transfer_reads_total"] > reads:
            return True
    return False


def peer_failures(url: str) -> float:
    """Hand-overs failed because of their prefill instance: gone or silent ("peer"), or a read
    in flight when it froze that ran past its deadline ("deadline"): which one depends on
    whether a read was under way at that moment."""
    metrics = scrape(url)
    return sum(metrics.get(f"tandem:kv_transfer_failures_total{{reason={reason}}}", 0.0)
               for reason in ("peer", "deadline"))


def blocks_held(url: str) -> tuple[float, float, float]:
    metrics = scrape(url)
    return (metrics["tandem:kv_blocks_used"], metrics["tandem:kv_blocks_pending_release"],
            metrics["tandem:kv_blocks_quarantined"])


def all_free(*urls: str, timeout_s: float = 15.0) -> bool:
    return wait_for(lambda: all(blocks_held(u) == (0, 0, 0) for u in urls), timeout_s)


def early_hand_over(prefill_url: str, prompt: list[int]) -> dict:
    reduced = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
               "kv_transfer_params": {"do_remote_decode": True}}
    response = httpx.post(f"{prefill_url}/v1/completions", json=reduced, headers=KV_SECRET, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["kv_transfer_params"]


@pytest.mark.timeout(240)
def test_streamed_answers_equal_colocated_and_read_chunk_by_chunk(cluster):
    prompt = _prompts(60, [12 * BLOCK + 5])[0]
    params = early_hand_over(cluster.prefill.url, prompt)
    assert params["stream"] is True and params["block_ids"] == [] and params["num_tokens"] == len(prompt)
    assert httpx.post(f"{cluster.prefill.url}/kv/release", json={"transfer_id": params["transfer_id"]},
                      headers=KV_SECRET, timeout=10).json()["released"] is True
    reads = scrape(cluster.decode.url)["tandem:kv_transfer_reads_total"]
    before = dispatched(cluster.router_url, "disaggregated")
    long_prompt = _prompts(61, [25 * BLOCK + 9])[0]
    for prompt in [_prompts(62, [5])[0], _prompts(63, [BLOCK + 1])[0], long_prompt]:
        assert answer_tokens(cluster.router_url, prompt) == answer_tokens(cluster.oracle.url, prompt)
    assert dispatched(cluster.router_url, "disaggregated") - before == 3
    # 25 blocks announced over 409 steps: read in more than one run while the prompt was computed
    assert scrape(cluster.decode.url)["tandem:kv_transfer_reads_total"] - reads > 3
    # the decode instance caches the long prompt's blocks: a prompt sharing 20 of them reads the rest
    shared = long_prompt[:20 * BLOCK] + _prompts(64, [3 * BLOCK + 7])[0]
    assert answer_tokens(cluster.router_url, shared) == answer_tokens(cluster.oracle.url, shared)
    assert all_free(cluster.prefill.url, cluster.decode.url)


@pytest.mark.timeout(120)
def test_the_early_hand_over_and_its_announcements_are_signed_as_documented(cluster):
    """Oracle: the MACs of tandem.handover_auth's docstring, recomputed with Python's hmac."""
    prompt = _prompts(66, [6 * BLOCK + 1])[0]
    params = early_hand_over(cluster.prefill.url, prompt)
    fields = {k: params[k] for k in (*SIGNED_FIELDS, "stream")}
    assert params["signature"] == _mac(b"tandem-handover-v1\n", fields)
    assert params["prompt_digest"] == prompt_digest(CLUSTER_SECRET, prompt)
    progress = f"{cluster.prefill.url}/kv/progress"
    query = {"transfer_id": params["transfer_id"], "known": 0}
    assert httpx.get(progress, params=query, timeout=10).status_code == 401
    while (announced := httpx.get(progress, params=query, headers=KV_SECRET, timeout=10).json())["state"] == "running":
        query["known"] = len(announced["block_ids"])
    assert announced["state"] == "done" and len(announced["block_ids"]) == 7
    assert len(announced["kv_checksums"]) == 7  # one per block, signed with them
    assert announced["signature"] == _mac(b"tandem-kv-announcement-v1\n", {
        k: announced[k] for k in ("transfer_id", "block_ids", "state", "kv_checksums")})
    assert httpx.post(f"{cluster.prefill.url}/kv/release", json={"transfer_id": params["transfer_id"]},
                      headers=KV_SECRET, timeout=10).json()["released"] is True
    assert all_free(cluster.prefill.url)


def _mac(domain: bytes, fields: dict) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(CLUSTER_SECRET.encode(), domain + canonical, hashlib.sha256).hexdigest()


def stopped_mid_stream(cluster: Cluster, decode: InstanceProcess, seed: int,
                       kill: bool = False) -> tuple[httpx.Response, list[int]]:
    """``decode``'s answer to a streamed hand-over of a prompt of STOPPED_TOKENS (made from
    ``seed``) whose prefill instance froze (SIGSTOP) once ``decode`` started reading, and was
    then killed if ``kill``; a frozen one is resumed afterwards. The decode instance must count
    exactly one peer failure for it. Returns the answer and the prompt.

    A freeze that lands after the prefill instance announced the whole prompt (a loaded machine
    can hold up the test's polling that long) leaves nothing to fail: the decode instance
    answers in full. The prefill instance is then resumed and tried again with a fresh prompt
    (twice at most). To be killed, it is frozen first and killed only if no answer came within
    KILL_GRACE_S (well under the decode instance's 5 s transfer timeout), so that a freeze that
    came too late is tried again while the instance is still alive."""
    last_attempt = 2
    attempt = 0
    while True:
        prompt = _prompts(seed + 1000 * attempt, [STOPPED_TOKENS])[0]
        reads = scrape(decode.url)["tandem:kv_transfer_reads_total"]
        failures = peer_failures(decode.url)
        params = early_hand_over(cluster.prefill.url, prompt)
        answer: dict = {}

        def ask() -> None:
            answer["response"] = httpx.post(
                f"{decode.url}/v1/completions", timeout=120, headers=KV_SECRET,
                json=body(prompt, kv_transfer_params={**params, "do_remote_prefill": True}))

        thread = threading.Thread(target=ask)
        thread.start()
        assert until_read(decode.url, reads)
        cluster.prefill.send_signal(signal.SIGSTOP)
        killed = False
        try:
            if kill:
                thread.join(KILL_GRACE_S)
                if thread.is_alive() or attempt == last_attempt:
                    cluster.prefill.kill()
                    killed = True
            thread.join(120)
            failed = peer_failures(decode.url) - failures
            too_late = failed == 0 and answer["response"].status_code == 200
            if not too_late or attempt == last_attempt:
                assert failed == 1
                if kill and not killed:
                    cluster.prefill.kill()
                    killed = True
                return answer["response"], prompt
        finally:
            if not killed:
                cluster.prefill.send_signal(signal.SIGCONT)
        attempt += 1


@pytest.mark.timeout(240)
def test_prefill_frozen_mid_stream_recomputes_and_holds_nothing_once_it_resumes(cluster):
    """After kv_transfer_timeout_s without an announcement the decode instance recomputes
    (blocks a read may still write into held apart); once the prefill instance resumes, its
    request ends, the pin the decode instance gave up is released, nothing stays held."""
    response, prompt = stopped_mid_stream(cluster, cluster.decode, 80)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["tokens"] == answer_tokens(cluster.oracle.url, prompt)
    assert all_free(cluster.prefill.url, cluster.decode.url, timeout_s=30)


@pytest.mark.timeout(240)
def test_prefill_frozen_mid_stream_is_a_502_under_the_fail_policy(cluster):
    warm = _prompts(82, [BLOCK + 3])[0]  # the handshake and NIXL peer first: the stream is not raced
    params = early_hand_over(cluster.prefill.url, warm)
    first = httpx.post(f"{cluster.strict.url}/v1/completions", timeout=120, headers=KV_SECRET,
                       json=body(warm, kv_transfer_params={**params, "do_remote_prefill": True}))
    assert first.json()["choices"][0]["logprobs"]["tokens"] == answer_tokens(cluster.oracle.url, warm)
    response, _ = stopped_mid_stream(cluster, cluster.strict, 81)
    assert response.status_code == 502 and response.json()["error"]["code"] == "kv_transfer_failed", response.text
    assert all_free(cluster.prefill.url, cluster.strict.url, timeout_s=30)


@pytest.mark.timeout(240)
def test_prefill_killed_mid_stream_recomputes_without_leaks(cluster, model_dir, log_dir):
    """(Last in this file: it leaves the cluster without its prefill instance.) The decode
    instance starts reading the announced blocks, then the prefill instance is frozen and killed
    before its prompt is done: the decode instance recomputes the prompt
    (policy "recompute") and answers like the oracle, every block of its own free."""
    response, prompt = stopped_mid_stream(cluster, cluster.decode, 70, kill=True)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]["tokens"] == answer_tokens(cluster.oracle.url, prompt)
    assert all_free(cluster.decode.url)
