"""Cache-aware routing and conditional disaggregation on a real cluster: a prefill and two decode
``tandem serve`` instances of the tiny Llama, each in its own test host (a network namespace on a
veth bridge, tests/helpers/netns.py) bound to its address, KV over NIXL with ``UCX_TLS=tcp``
across the bridge, each publishing its KV events over ZMQ on its address; the router, in the
test's namespace, with ``decode_routing_policy = "cache_aware"`` and
``min_uncached_prefill_tokens = 32`` (two blocks), subscribes to them across the bridge.

Oracles: which instance holds what is arranged by the test (a conversation sent straight to one
decode instance, bypassing the router), the instance's own ``cached_tokens`` in its answer's
usage, the router's per-instance counters, and greedy text equal to a cold instance's.

Without root, or where namespaces cannot be made, every test here skips and says why.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tandem.router.registry import Step
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.netns import TestHosts, test_hosts
from tests.router.instances import ADMIN, MODEL_NAME, dispatched, running_router, upstream, wait_for
from tests.router.xpyd import SECRET, HostedInstance, instance_config, toml

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")
pytestmark = pytest.mark.timeout(300)

BLOCK = 16
ENGINE = {"num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 256, "num_threads": 1}
DISAGGREGATION = {"kv_expiry_s": 30.0, "kv_transfer_timeout_s": 5.0}
ROLES = ("prefill", "decode", "decode")


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    with test_hosts(len(ROLES)) as net:
        yield net


@pytest.fixture(scope="module")
def instances(hosts, model_dir, log_dir) -> Iterator[list[HostedInstance]]:
    procs = []
    for host, role in zip(hosts, ROLES):
        events = {"enabled": True, "endpoint": f"tcp://{host.address}:0",
                  "replay_endpoint": f"tcp://{host.address}:0"}
        config = {**instance_config(model_dir, host, role, ENGINE, DISAGGREGATION), "kv_events": events}
        path = log_dir / f"cache-aware-{role}-{host.address}.toml"
        path.write_text(toml(config))
        procs.append(HostedInstance(host, role, path, log_dir / f"cache-aware-{role}-{host.address}.log").start())
    for proc in procs:
        proc.wait_ready()
    yield procs     # the hosts' teardown kills them


@pytest.fixture(scope="module")
def router(instances):
    listed = [(proc.url, proc.role) for proc in instances]
    with running_router(listed, decode_routing_policy="cache_aware", min_uncached_prefill_tokens=2 * BLOCK,
                        kv_transfer_secret=SECRET) as server:
        assert wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200)
        yield server


def index_blocks(router, url: str) -> int:
    return router.app.state.dispatcher.policies[Step.DECODE].index.num_blocks(url)


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def decode_attempts(router, url: str) -> float:
    return upstream(router.url, url, "decode", "ok")


def test_a_turn_goes_to_the_decode_instance_holding_its_conversation_and_is_decoded_there(instances, router):
    _, first, second = instances
    conversation = _prompts(10, [6 * BLOCK + 3])[0]
    complete(second.url, conversation)          # only the second decode instance holds it
    assert wait_for(lambda: index_blocks(router, second.url) >= 6)
    before = {u: decode_attempts(router, u) for u in (first.url, second.url)}
    in_place = dispatched(router.url, "cached_prefix")
    turn = conversation + _prompts(11, [8])[0]  # 107 tokens, 96 cached there: 11 < 32 uncached
    answer = complete(router.url, turn)
    assert dispatched(router.url, "cached_prefix") == in_place + 1
    assert decode_attempts(router, second.url) == before[second.url] + 1
    assert decode_attempts(router, first.url) == before[first.url]
    assert cached(answer) == 6 * BLOCK
    cold = complete(first.url, turn)            # the first instance computes it all
    assert cached(cold) == 0 and answer["choices"][0]["text"] == cold["choices"][0]["text"]


def test_a_new_conversation_is_handed_over_and_its_next_turn_decoded_in_place(instances, router):
    conversation = _prompts(20, [8 * BLOCK + 2])[0]
    handed_over = dispatched(router.url, "disaggregated")
    before = {p.url: decode_attempts(router, p.url) for p in instances[1:]}
    first_turn = complete(router.url, conversation)
    assert dispatched(router.url, "disaggregated") == handed_over + 1
    (holder,) = [p.url for p in instances[1:] if decode_attempts(router, p.url) > before[p.url]]
    assert wait_for(lambda: index_blocks(router, holder) >= 8)
    in_place = dispatched(router.url, "cached_prefix")
    turn = conversation + _prompts(21, [6])[0]
    answer = complete(router.url, turn)
    assert dispatched(router.url, "cached_prefix") == in_place + 1
    assert decode_attempts(router, holder) == before[holder] + 2
    assert cached(answer) == 8 * BLOCK
    other = next(p.url for p in instances[1:] if p.url != holder)
    assert answer["choices"][0]["text"] == complete(other, turn)["choices"][0]["text"]
    assert first_turn["choices"][0]["text"] == complete(other, conversation)["choices"][0]["text"]


def test_an_instance_out_of_rotation_is_forgotten_and_replayed_when_it_is_back(instances, router):
    _, _, second = instances
    conversation = _prompts(30, [5 * BLOCK + 1])[0]
    complete(second.url, conversation)
    assert wait_for(lambda: index_blocks(router, second.url) >= 5)
    removed = httpx.delete(f"{router.url}/admin/instances", params={"url": second.url}, headers=ADMIN, timeout=10)
    assert removed.status_code == 200 and index_blocks(router, second.url) == 0
    added = httpx.post(f"{router.url}/admin/instances", json={"url": second.url, "role": "decode"},
                       headers=ADMIN, timeout=10)
    assert added.status_code == 201 and added.json()["healthy"]
    assert wait_for(lambda: index_blocks(router, second.url) >= 5)   # replayed from its buffer
    before = decode_attempts(router, second.url)
    answer = complete(router.url, conversation + _prompts(31, [4])[0])
    assert decode_attempts(router, second.url) == before + 1 and cached(answer) == 5 * BLOCK


def test_a_chat_is_hashed_from_the_instances_own_tokenization(instances, router):
    _, first, second = instances
    rng_words = " ".join(f"w{i % 97}" for i in range(60))
    messages = [{"role": "system", "content": rng_words}, {"role": "user", "content": "first question"}]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    direct = httpx.post(f"{second.url}/v1/chat/completions", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    held = direct.json()["usage"]["prompt_tokens"] // BLOCK
    assert held >= 4 and wait_for(lambda: index_blocks(router, second.url) >= held)
    before = decode_attempts(router, second.url)
    follow_up = {**body, "messages": messages + [{"role": "assistant", "content": "an answer"},
                                                 {"role": "user", "content": "and then?"}]}
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=follow_up, timeout=120)
    assert answer.status_code == 200, answer.text
    assert decode_attempts(router, second.url) == before + 1
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= (held - 1) * BLOCK
