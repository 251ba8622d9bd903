"""The router when instances fail: killed (kill -9) or frozen subprocesses, an instance whose queue
is full (429) and one that is shutting down (503). Every request must still get the answer a
healthy colocated instance gives (greedy), and the router's /admin/instances and /metrics must
show who left rotation and who came back."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from tandem.engine import LLMEngine
from tests.router.instances import (
    ADMIN,
    MODEL_NAME,
    InstanceProcess,
    completion,
    dispatched,
    router_instance,
    running_router,
    scrape,
    upstream,
    wait_for,
)
from tests.server.conftest import running_server, server_config

BODY = {"model": MODEL_NAME, "prompt": "The health of an instance", "max_tokens": 8, "temperature": 0}


def text_of(url: str, body: dict = BODY) -> str:
    return completion(url, body)["choices"][0]["text"]


def healthy_gauge(router_url: str, url: str, role: str) -> float:
    return scrape(router_url)[f"tandem:router_instance_healthy{{instance={url},role={role}}}"]


def in_flight(router_url: str, url: str, role: str) -> float:
    return scrape(router_url)[f"tandem:router_instance_in_flight{{instance={url},role={role}}}"]


def generated(url: str) -> float:
    return scrape(url)["tandem:generation_tokens_total"]


@pytest.fixture
def victim(model_dir, log_dir):
    """A decode-able instance of its own, to be killed."""
    proc = InstanceProcess(model_dir, log_dir).start().wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


def test_a_killed_instance_leaves_rotation_and_comes_back_when_restarted(cluster, victim):
    survivor = cluster.decode[0].url
    expected = text_of(survivor)
    with running_router([(victim.url, "decode"), (survivor, "decode")],
                        decode_routing_policy="round_robin") as router:
        assert wait_for(lambda: router_instance(router.url, victim.url)["healthy"])
        victim.kill()
        assert wait_for(lambda: not router_instance(router.url, victim.url)["healthy"], 5)
        assert healthy_gauge(router.url, victim.url, "decode") == 0
        assert [text_of(router.url) for _ in range(4)] == [expected] * 4
        assert upstream(router.url, survivor, "decode", "ok") == 4

        victim.start().wait_ready()  # the same port again
        assert wait_for(lambda: router_instance(router.url, victim.url)["healthy"], 5)
        assert healthy_gauge(router.url, victim.url, "decode") == 1
        assert [text_of(router.url) for _ in range(2)] == [expected] * 2  # round robin: one each
        assert upstream(router.url, victim.url, "decode", "ok") == 1


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_decode_instance_dying_before_its_first_token_is_replaced(cluster, victim, stream):
    survivor = cluster.decode[0].url
    expected = text_of(survivor)
    instances = [(cluster.prefill.url, "prefill"), (victim.url, "decode"), (survivor, "decode")]
    with running_router(instances, health_interval_s=60, decode_routing_policy="round_robin") as router:
        victim.send_signal(signal.SIGSTOP)  # the kernel still accepts its connections; it never answers
        result = {}

        def ask() -> None:
            llm = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=60)
            if stream:
                chunks = llm.completions.create(stream=True, **BODY)
                result["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
            else:
                result["text"] = llm.completions.create(**BODY).choices[0].text

        asker = threading.Thread(target=ask)
        asker.start()
        assert wait_for(lambda: in_flight(router.url, victim.url, "decode") == 1)
        time.sleep(0.3)  # the request is on the wire to the frozen instance
        victim.kill()
        asker.join(60)
        assert result["text"] == expected
        assert upstream(router.url, victim.url, "decode", "unreachable") == 1
        assert upstream(router.url, survivor, "decode", "ok") == 1
        assert router_instance(router.url, victim.url)["healthy"] is False


def test_an_unreachable_prefill_instance_is_replaced_by_another_then_by_the_decode_instance(cluster, victim):
    prefill, decode = cluster.prefill.url, cluster.decode[0].url
    expected = text_of(decode)
    instances = [(victim.url, "prefill"), (prefill, "prefill"), (decode, "decode")]
    with running_router(instances, health_interval_s=60, routing_policy="round_robin") as router:
        victim.kill()  # the router's last health check saw it alive
        before = generated(prefill)
        assert text_of(router.url) == expected  # round robin tries the dead one first
        assert upstream(router.url, victim.url, "prefill", "unreachable") == 1
        assert generated(prefill) == before + 1
        assert dispatched(router.url, "disaggregated") == 1

        assert httpx.delete(f"{router.url}/admin/instances", params={"url": prefill}, headers=ADMIN).status_code == 200
        assert text_of(router.url) == expected  # no prefill instance left in rotation
        assert generated(prefill) == before + 1
        assert dispatched(router.url, "local_prefill") == 1


def slow_engine(config, step_delay_s: float):
    def build() -> LLMEngine:
        engine = LLMEngine(config)
        step = engine.step

        def slow_step():
            time.sleep(step_delay_s)
            return step()

        engine.step = slow_step
        return engine

    return build


def test_an_instance_with_a_full_queue_sends_the_request_to_another(cluster, model_dir):
    survivor = cluster.decode[0].url
    expected = text_of(survivor)
    config = server_config(model_dir, served_model_name=MODEL_NAME, max_num_seqs=1, max_queued_requests=1)
    with running_server(config, engine_factory=slow_engine(config, 0.05)) as busy, \
            running_router([(busy.url, "decode"), (survivor, "decode")], health_interval_s=60,
                           decode_routing_policy="round_robin") as router:
        running = threading.Thread(target=httpx.post, args=(f"{busy.url}/v1/completions",),
                                   kwargs={"json": {"prompt": "a", "max_tokens": 60, "ignore_eos": True},
                                           "timeout": 60})
        waiting = threading.Thread(target=httpx.post, args=(f"{busy.url}/v1/completions",),
                                   kwargs={"json": {"prompt": "b", "max_tokens": 1}, "timeout": 60})
        running.start()
        assert wait_for(lambda: scrape(busy.url)["tandem:num_requests_running"] == 1)
        waiting.start()
        assert wait_for(lambda: scrape(busy.url)["tandem:num_requests_waiting"] == 1)
        assert text_of(router.url) == expected
        assert upstream(router.url, busy.url, "decode", "busy") == 1
        assert upstream(router.url, survivor, "decode", "ok") == 1
        assert router_instance(router.url, busy.url)["healthy"] is True
        running.join(60)
        waiting.join(60)


def test_an_instance_answering_503_leaves_rotation(cluster, model_dir):
    survivor = cluster.decode[0].url
    expected = text_of(survivor)
    config = server_config(model_dir, served_model_name=MODEL_NAME)
    with running_server(config) as closing, \
            running_router([(closing.url, "decode"), (survivor, "decode")], health_interval_s=60,
                           decode_routing_policy="round_robin") as router:
        closing.engine.begin_shutdown(30)
        assert [text_of(router.url) for _ in range(3)] == [expected] * 3
        assert upstream(router.url, closing.url, "decode", "unavailable") == 1  # then out of rotation
        assert upstream(router.url, survivor, "decode", "ok") == 3
        assert router_instance(router.url, closing.url)["reason"] == "answered 503"
        assert healthy_gauge(router.url, closing.url, "decode") == 0
