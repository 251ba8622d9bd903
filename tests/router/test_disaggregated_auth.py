"""Hand-overs between real instances (``tandem serve`` subprocesses, NIXL/UCX on 127.0.0.1) that
share a cluster secret, through the router in this process (issue 12): bodies a prefill
instance accepts and the decode instance refuses leave no pinned block behind, and a restarted
prefill instance (a new process, so a new engine id, on the same port) is handshaken again and
serves hand-overs. The oracle is a colocated instance's greedy answer; blocks are read from each
instance's /metrics.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.router.instances import (
    MODEL_NAME,
    InstanceProcess,
    dispatched,
    role_env,
    router_instance,
    running_router,
    scrape,
    upstream,
    wait_for,
)

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")

SECRET = "router-flow-cluster-secret-7c1d"
SECRET_ENV = {"TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": SECRET}
EXPIRY_S = 120.0  # the default: a pin that waits for its expiry outlives the test
BLOCK = 16


def body(prompt: list[int], **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, **extra}


def tokens(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["tokens"]


def pinned(url: str) -> tuple[float, float]:
    metrics = scrape(url)
    return metrics["tandem:kv_blocks_pending_release"], metrics["tandem:kv_blocks_used"]


def engine_id(url: str) -> str:
    return httpx.get(f"{url}/kv/handshake", headers={"X-Tandem-KV-Secret": SECRET}, timeout=10).json()["engine_id"]


@dataclass
class Cluster:
    oracle: InstanceProcess
    prefill: InstanceProcess
    decode: InstanceProcess
    router_url: str


@pytest.fixture(scope="module")
def cluster(model_dir, log_dir, colocated) -> Iterator[Cluster]:
    prefill = InstanceProcess(model_dir, log_dir, **role_env("prefill", EXPIRY_S, **SECRET_ENV)).start()
    decode = InstanceProcess(model_dir, log_dir, **role_env("decode", EXPIRY_S, **SECRET_ENV)).start()
    cluster = Cluster(colocated, prefill, decode, "")
    try:
        for proc in (prefill, decode):
            proc.wait_ready()
        with running_router([(prefill.url, "prefill"), (decode.url, "decode")],
                            kv_transfer_secret=SECRET) as router:
            cluster.router_url = router.url
            yield cluster
    finally:
        # the instances as the tests left them too (a test may replace one with a restarted process)
        for proc in {id(p): p for p in (prefill, decode, cluster.prefill, cluster.decode)}.values():
            proc.stop()


@pytest.mark.timeout(180)
def test_hand_overs_with_the_secret_equal_colocated(cluster):
    prompt = _prompts(70, [3 * BLOCK + 4])[0]
    before = dispatched(cluster.router_url, "disaggregated")
    read = scrape(cluster.decode.url)["tandem:kv_transfer_bytes_total"]
    answer = httpx.post(f"{cluster.router_url}/v1/completions", json=body(prompt), timeout=120)
    assert tokens(answer) == tokens(httpx.post(f"{cluster.oracle.url}/v1/completions", json=body(prompt),
                                               timeout=120))
    assert dispatched(cluster.router_url, "disaggregated") - before == 1
    assert scrape(cluster.decode.url)["tandem:kv_transfer_bytes_total"] > read
    assert wait_for(lambda: pinned(cluster.prefill.url) == (0, 0), 10)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("refused, num_prefills", [
    ({"logprobs": 50}, 1), ({"min_tokens": 9}, 1), ({"echo": True, "logprobs": 50}, 0),
], ids=["logprobs above max_logprobs", "min_tokens above max_tokens", "echo"])
def test_a_body_the_decode_instance_refuses_leaves_no_pin_on_the_prefill_instance(cluster, refused, num_prefills):
    """The router drops these fields from the prefill step, so the prefill instance accepts the
    request and pins its blocks; the decode instance refuses it (400). Before the router released
    such hand-overs, the blocks stayed pinned for kv_expiry_s (120 s). A request about its prompt
    itself (echo) is never split: it goes to the decode instance alone, which refuses it."""
    prompt = _prompts(71 + len(str(refused)), [4 * BLOCK + 2])[0]
    prefilled = upstream(cluster.router_url, cluster.prefill.url, "prefill", "ok")
    answer = httpx.post(f"{cluster.router_url}/v1/completions", json=body(prompt, **refused), timeout=120)
    assert answer.status_code == 400, answer.text
    assert upstream(cluster.router_url, cluster.prefill.url, "prefill", "ok") - prefilled == num_prefills
    assert pinned(cluster.prefill.url) == (0, 0)  # right after the answer: no wait for an expiry
    assert scrape(cluster.decode.url)["tandem:kv_blocks_used"] == 0


@pytest.mark.timeout(300)
def test_a_restarted_prefill_instance_is_handshaken_again(cluster, model_dir, log_dir):
    prompt = _prompts(72, [2 * BLOCK + 7])[0]
    oracle = tokens(httpx.post(f"{cluster.oracle.url}/v1/completions", json=body(prompt), timeout=120))
    assert tokens(httpx.post(f"{cluster.router_url}/v1/completions", json=body(prompt), timeout=120)) == oracle
    old_engine = engine_id(cluster.prefill.url)
    cluster.prefill.kill()
    assert wait_for(lambda: not router_instance(cluster.router_url, cluster.prefill.url)["healthy"], 10)
    restarted = InstanceProcess(model_dir, log_dir, port=cluster.prefill.port,
                                **role_env("prefill", EXPIRY_S, **SECRET_ENV)).start().wait_ready()
    cluster.prefill = restarted  # stopped by the fixture
    assert engine_id(restarted.url) != old_engine
    assert wait_for(lambda: router_instance(cluster.router_url, restarted.url)["healthy"], 10)
    other = _prompts(73, [3 * BLOCK + 1])[0]  # not in the decode instance's prefix cache
    before = dispatched(cluster.router_url, "disaggregated")
    read = scrape(cluster.decode.url)["tandem:kv_transfer_bytes_total"]
    answer = httpx.post(f"{cluster.router_url}/v1/completions", json=body(other), timeout=120)
    assert tokens(answer) == tokens(httpx.post(f"{cluster.oracle.url}/v1/completions", json=body(other),
                                               timeout=120))
    assert dispatched(cluster.router_url, "disaggregated") - before == 1
    # the KV came from the new process, read with its new handshake
    assert scrape(cluster.decode.url)["tandem:kv_transfer_bytes_total"] - read == 3 * scrape_block_bytes(restarted)
    assert scrape(cluster.decode.url).get("tandem:kv_transfer_failures_total{reason=peer}", 0) == 0
    assert wait_for(lambda: pinned(restarted.url) == (0, 0), 10)


def scrape_block_bytes(instance: InstanceProcess) -> int:
    return httpx.get(f"{instance.url}/kv/handshake", headers={"X-Tandem-KV-Secret": SECRET},
                     timeout=10).json()["block_bytes"]
