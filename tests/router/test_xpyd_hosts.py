"""xPyD across test hosts (tests/router/xpyd.py): two prefill and two decode ``tandem serve``
instances, each in its own network namespace bound to its address, KV over NIXL/UCX with
``UCX_TLS=tcp`` across a veth bridge, ``tandem router --config`` in this namespace. The oracle is
the offline ``tandem.LLM`` on the same checkpoint and engine settings: greedy text through the
router must equal its text. Faults are ``kill -9`` of one prefill and one decode instance under
16 concurrent streams; blocks are counted through the survivors' /metrics; the killed instances
come back on the same address and port and must rejoin the router's rotation.

Without root, or where namespaces cannot be made, every test here skips and says why.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tandem.router.prompts import decode_body, prefill_body
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.netns import test_hosts
from tests.router.instances import MODEL_NAME, free_port, scrape, wait_for
from tests.router.xpyd import (
    ADMIN_HEADERS,
    XPyD,
    HostedInstance,
    Load,
    blocks_held,
    instance_config,
    is_busy,
    kv_headers,
    kv_load_failures,
    metric,
    router_config,
    start_router,
    stop,
    toml,
    upstream_outcomes,
)

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")

BLOCK = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
"""One KV block of the tiny Llama: 2 layers x K/V x 16 tokens x 2 KV heads x head size 16 x 4 bytes."""
ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 512, "num_threads": 1}
KV_TRANSFER_TIMEOUT_S = 3.0
KV_EXPIRY_S = 5.0
INSTANCE_DISAGGREGATION = {"kv_transfer_timeout_s": KV_TRANSFER_TIMEOUT_S, "kv_expiry_s": KV_EXPIRY_S,
                           "kv_load_failure_policy": "recompute"}
MIN_DISAGGREGATED_TOKENS = 32
ROUTER_DISAGGREGATION = {"routing_policy": "round_robin", "decode_routing_policy": "round_robin",
                         "min_disaggregated_prompt_tokens": MIN_DISAGGREGATED_TOKENS}
HEALTH_INTERVAL_S = 0.5
MAX_TOKENS = 24
STREAMS = 16
REQUEST_BOUND_S = KV_TRANSFER_TIMEOUT_S + 45.0
"""The longest a request may take under the load, kills included: a failed load costs at most
the transfer deadline, then the prompt is recomputed; the rest is generation on two busy cores."""
DISAGGREGATED = "tandem:router_requests_total{path=disaggregated}"


def body(prompt: list[int], **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, **extra}


def long_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts of 2 to 6 blocks: all above the router's disaggregation threshold."""
    return _prompts(seed, [2 * BLOCK + 3 + (i * 23) % (4 * BLOCK) for i in range(count)])


def completion_text(router_url: str, prompt: list[int]) -> str:
    response = httpx.post(f"{router_url}/v1/completions", json=body(prompt), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def all_free(instances: list[HostedInstance], timeout_s: float) -> dict[str, tuple[float, float]]:
    """Each instance's (blocks used, blocks pinned) once both are 0, or at ``timeout_s``."""
    for instance in instances:
        wait_for(lambda: blocks_held(instance.url) == (0, 0), timeout_s)
    return {i.url: blocks_held(i.url) for i in instances}


@pytest.fixture(scope="module")
def oracle(model_dir):
    """Colocated greedy text: the offline engine with the instances' engine settings."""
    from tandem import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return lambda prompts: [out.outputs[0].text for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def xpyd(model_dir: Path, tmp_path_factory) -> Iterator[XPyD]:
    work = tmp_path_factory.mktemp("xpyd")
    with test_hosts(4) as net:
        instances = []
        for host, role in zip(net, ["prefill", "prefill", "decode", "decode"]):
            config = work / f"{role}-h{host.index}.toml"
            config.write_text(toml(instance_config(model_dir, host, role, ENGINE, INSTANCE_DISAGGREGATION)))
            instances.append(HostedInstance(host, role, config, work / f"{role}-h{host.index}.log").start())
        port = free_port()
        (work / "router.toml").write_text(toml(router_config(port, instances, ROUTER_DISAGGREGATION)))
        router = start_router(work / "router.toml", work / "router.log", HEALTH_INTERVAL_S)
        cluster = XPyD(net, instances[:2], instances[2:], f"http://127.0.0.1:{port}", work / "router.log")
        try:
            started = time.monotonic()
            for instance in instances:
                instance.wait_ready()
            assert wait_for(lambda: cluster.healthy() == {i.url for i in instances}, 30), cluster.logs()
            print(f"\nxPyD on {net.subnet}: 4 instances and the router ready in "
                  f"{time.monotonic() - started:.1f} s")
            yield cluster
        finally:
            stop(router)


def routed_pairs(xpyd: XPyD, prompts: list[list[int]], expected: list[str]) -> set[tuple[str, str]]:
    """Send each prompt through the router and check its text; return the (prefill, decode)
    pairs that served them, as each instance's metrics show: the prefill instance whose prompt
    tokens grew, the decode instance that read the KV — every block of it, across the bridge.

    Before every fourth prompt from the third on, a short prompt goes to a decode instance
    alone: under round robin on both steps, the first four long prompts then meet all four pairs."""
    pairs = set()
    for i, prompt in enumerate(prompts):
        if i % 4 == 2:
            assert completion_text(xpyd.router_url, _prompts(99, [5])[0])
        prompt_tokens = [metric(p.url, "tandem:prompt_tokens_total") for p in xpyd.prefill]
        kv_bytes = [metric(d.url, "tandem:kv_transfer_bytes_total") for d in xpyd.decode]
        bridged = [xpyd.net.bytes_to_host(d.host.index) for d in xpyd.decode]
        assert completion_text(xpyd.router_url, prompt) == expected[i], xpyd.logs()
        prefilled_by = [p for p, before in zip(xpyd.prefill, prompt_tokens)
                        if metric(p.url, "tandem:prompt_tokens_total") > before]
        read = [(d, metric(d.url, "tandem:kv_transfer_bytes_total") - before, bridged_before)
                for d, before, bridged_before in zip(xpyd.decode, kv_bytes, bridged)]
        read = [r for r in read if r[1] > 0]
        assert len(prefilled_by) == 1 and len(read) == 1, (prefilled_by, read, xpyd.logs())
        decode, nbytes, bridged_before = read[0]
        assert nbytes == -(-(len(prompt) - 1) // BLOCK) * BLOCK_BYTES  # every block but the last token's
        # the kernel counted at least those bytes across the veth pair into the decode host
        assert xpyd.net.bytes_to_host(decode.host.index) - bridged_before >= nbytes
        pairs.add((prefilled_by[0].url, decode.url))
    return pairs


@pytest.mark.timeout(420)
def test_greedy_text_through_router_equals_colocated_with_kv_across_hosts(xpyd, oracle):
    prompts = long_prompts(100, 6)
    expected = oracle(prompts)
    # STYLE.md rule 12: this model's greedy text depends on each prompt's first block
    other_start = [_prompts(101 + i, [BLOCK])[0] + p[BLOCK:] for i, p in enumerate(prompts)]
    assert all(a != b for a, b in zip(expected, oracle(other_start)))
    disaggregated = metric(xpyd.router_url, DISAGGREGATED)
    pairs = routed_pairs(xpyd, prompts, expected)
    assert metric(xpyd.router_url, DISAGGREGATED) - disaggregated == len(prompts)
    assert len(pairs) == 4, pairs  # each decode instance read KV from each prefill instance
    held = all_free(xpyd.instances, 10)
    assert set(held.values()) == {(0, 0)}, held


@pytest.mark.timeout(420)
def test_kill_9_of_a_prefill_and_a_decode_instance_under_load(xpyd, oracle):
    prompts = long_prompts(200, 12)
    victims, survivors = [xpyd.prefill[0], xpyd.decode[1]], [xpyd.prefill[1], xpyd.decode[0]]
    assert all(v.alive for v in victims), "the victims are not running: restart them first"
    load = Load(xpyd.router_url, prompts, oracle(prompts), body, STREAMS, REQUEST_BOUND_S)
    upstream_before = upstream_outcomes(xpyd.router_url)
    kill = load.run_with_kills(victims, warmup_s=5.0, after_s=10.0)
    load_done = time.monotonic()
    seen_kill = kill.at + 4 * HEALTH_INTERVAL_S + 1.0
    after_kill = [o for o in load.outcomes if o.started > seen_kill]
    upstream = {k: v - upstream_before.get(k, 0) for k, v in upstream_outcomes(xpyd.router_url).items()}
    print(f"\nkill -9 under {STREAMS} streams: {len(load.outcomes)} requests, {load.kinds()}; the victims "
          f"held {kill.held}; out of the router's rotation {kill.out_of_rotation_s} s after the kill; "
          f"slowest request {max(o.seconds for o in load.outcomes):.1f} s; {len(after_kill)} requests "
          f"started after the router had seen the kill; router attempts by outcome {upstream}")
    assert all(is_busy(kill.held[v.url]) for v in victims), f"a victim held no work when killed: {kill.held}"
    assert kill.out_of_rotation_s is not None, "the router kept a killed instance in rotation"
    bad = [o for o in load.outcomes if o.kind in ("wrong_text", "broken", "hang")]
    assert not bad, (bad[:3], xpyd.logs())  # an answer, a retried answer or a clear error, in time
    assert max(o.seconds for o in load.outcomes) <= REQUEST_BOUND_S
    late_failures = [o for o in after_kill if o.kind != "ok"]
    assert after_kill and not late_failures, late_failures[:3]  # the router routes around the dead
    assert xpyd.healthy() == {s.url for s in survivors}
    # idle now: nothing stays pinned (at most until kv_expiry_s) or in use on the survivors
    held = all_free(survivors, KV_EXPIRY_S + 10)
    failures = {s.url: {k: v for k, v in scrape(s.url).items() if k.startswith("tandem:kv_transfer_failures")}
                for s in survivors}
    print(f"survivors' (blocks used, blocks pinned) {time.monotonic() - load_done:.1f} s after the load: "
          f"{held}; their KV transfer failures {failures}")
    assert set(held.values()) == {(0, 0)}, (held, xpyd.logs())


@pytest.mark.timeout(420)
def test_restarted_instances_rejoin_rotation(xpyd, oracle):
    restarted = [xpyd.prefill[0], xpyd.decode[1]]
    for instance in restarted:
        if instance.alive:  # when run alone
            instance.kill()
    assert wait_for(lambda: not xpyd.healthy() & {i.url for i in restarted}, 10)
    began = time.monotonic()
    for instance in restarted:
        instance.start()
    for instance in restarted:
        instance.wait_ready()
    ready = time.monotonic()
    every = {i.url for i in xpyd.instances}
    assert wait_for(lambda: xpyd.healthy() == every, 10), httpx.get(f"{xpyd.router_url}/health", headers=ADMIN_HEADERS).text
    print(f"\nrestarted on the same address and port: ready {ready - began:.1f} s after the start, "
          f"in the router's rotation {time.monotonic() - ready:.2f} s later")
    prompts = long_prompts(300, 6)
    prefill, decode = restarted
    served = (metric(prefill.url, "tandem:prompt_tokens_total"),
              metric(decode.url, "tandem:generation_tokens_total"))
    failures = {d.url: kv_load_failures(d.url) for d in xpyd.decode}
    pairs = routed_pairs(xpyd, prompts, oracle(prompts))
    # both restarted instances serve again, each with both of the other role: KV read, no load failed
    assert len(pairs) == 4, pairs
    assert metric(prefill.url, "tandem:prompt_tokens_total") > served[0]
    assert metric(decode.url, "tandem:generation_tokens_total") > served[1]
    assert {d.url: kv_load_failures(d.url) for d in xpyd.decode} == failures, xpyd.logs()
    held = all_free(xpyd.instances, 10)
    assert set(held.values()) == {(0, 0)}, held


def hand_over(prefill: HostedInstance, request: dict) -> dict:
    """The prefill step of ``request`` on ``prefill``, as the router sends it; the answer's
    ``kv_transfer_params``."""
    answer = httpx.post(f"{prefill.url}/v1/completions", json=prefill_body(request), headers=kv_headers(),
                        timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def decode_step(decode: HostedInstance, request: dict, kv_transfer_params: dict) -> httpx.Response:
    return httpx.post(f"{decode.url}/v1/completions", json=decode_body(request, kv_transfer_params),
                      headers=kv_headers(), timeout=120)


@pytest.mark.timeout(300)
def test_prefill_killed_while_a_decode_instance_reads_from_it_across_hosts(xpyd, oracle):
    """The kill the load test cannot time: the decode instance's read is in flight (its prefill
    instance frozen, then killed -9). The read fails as the peer's (the TCP connection across the
    bridge resets), well before the transfer deadline; the prompt is recomputed."""
    prefill, decode = xpyd.prefill[1], xpyd.decode[0]
    assert prefill.alive and decode.alive
    warm, prompt = long_prompts(400, 2)
    answer = decode_step(decode, body(warm), hand_over(prefill, body(warm)))  # the handshake, cached
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == oracle([warm])[0]
    params = hand_over(prefill, body(prompt))
    failures = scrape(decode.url).get("tandem:kv_transfer_failures_total{reason=peer}", 0.0)
    prefill.proc.send_signal(signal.SIGSTOP)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(decode_step, decode, body(prompt), params)
        assert wait_for(lambda: blocks_held(decode.url)[0] > 0, 10)  # blocks allocated, the read waits
        time.sleep(0.5)
        assert not pending.done()
        killed = time.monotonic()
        prefill.kill()
        answer = pending.result(timeout=60)
        seconds = time.monotonic() - killed
    print(f"\nprefill killed during a read: the decode instance answered {seconds:.2f} s later")
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == oracle([prompt])[0]
    assert scrape(decode.url).get("tandem:kv_transfer_failures_total{reason=peer}", 0.0) == failures + 1
    assert seconds < KV_TRANSFER_TIMEOUT_S
    held = all_free([decode], 10)
    assert set(held.values()) == {(0, 0)}, held
    prefill.start().wait_ready()  # the cluster whole again
    assert wait_for(lambda: xpyd.healthy() == {i.url for i in xpyd.instances}, 10)
