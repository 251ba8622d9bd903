"""The server under load and failure: shared batches, client disconnects, a full queue, engine
faults, loading, API keys.

Servers here wrap the engine (``create_app(engine_factory=...)``) to slow its steps down, so
that timing-dependent behaviour (a queue that fills, a stream cut mid-way) is deterministic.
Oracles: Prometheus text parsed by ``prometheus_client``'s own parser, hand-counted statuses."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import openai
import pytest

from tandem.engine import LLMEngine
from tandem.server.app import create_app
from tests.server.server_helpers import ServerThread, running_server, scrape, server_config


def _slow_engine(config, step_delay_s: float = 0.0, load_delay_s: float = 0.0, fail_after_steps=None):
    def build() -> LLMEngine:
        time.sleep(load_delay_s)
        engine = LLMEngine(config)
        real_step, steps = engine.step, [0]

        def step():
            steps[0] += 1
            if fail_after_steps is not None and steps[0] > fail_after_steps:
                raise RuntimeError("injected fault")
            time.sleep(step_delay_s)
            return real_step()

        engine.step = step
        return engine

    return build


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_concurrent_requests_share_batches(server):
    before = scrape(server.url)

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(
                c.post("/v1/completions", json={"prompt": f"def f{i}():", "max_tokens": 24,
                                                "ignore_eos": True})
                for i in range(8)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    after = scrape(server.url)
    steps = after["tandem:batch_size_count"] - before["tandem:batch_size_count"]
    single = after['tandem:batch_size_bucket{le=1.0}'] - before['tandem:batch_size_bucket{le=1.0}']
    assert steps > 0 and single < steps, "some steps ran more than one sequence"
    assert after["tandem:generation_tokens_total"] - before["tandem:generation_tokens_total"] == 8 * 24
    assert after["tandem:request_success_total{finish_reason=length}"] - \
        before.get("tandem:request_success_total{finish_reason=length}", 0) == 8
    ttft = "tandem:time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == 8
    assert after["tandem:inter_token_latency_seconds_count"] - \
        before["tandem:inter_token_latency_seconds_count"] == 8 * 23
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_blocks_used",
                 "kv_blocks_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "iteration_tokens_count",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert f"tandem:{name}" in after
    assert after["tandem:kv_blocks_total"] == 63


def test_tokens_leave_as_they_are_sampled(model_dir):
    config = server_config(model_dir)
    with running_server(config, engine_factory=_slow_engine(config, step_delay_s=0.05)) as srv:
        arrivals = []
        body = {"prompt": "def main():", "max_tokens": 10, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
    assert len(arrivals) == 10, "one chunk per token"
    assert arrivals[-1] - arrivals[0] > 0.3, "the first token left long before the last"


def test_client_disconnect_mid_stream_frees_blocks(model_dir):
    config = server_config(model_dir)
    with running_server(config, engine_factory=_slow_engine(config, step_delay_s=0.02)) as srv:
        body = {"prompt": "def main():", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(3):
                while not next(lines).startswith("data: "):
                    pass
            in_use = scrape(srv.url)["tandem:kv_blocks_used"]
        assert in_use > 0
        assert _wait_for(lambda: scrape(srv.url)["tandem:kv_blocks_used"] == 0, 5.0)
        after = scrape(srv.url)
        assert after["tandem:num_requests_running"] == 0
        assert after["tandem:generation_tokens_total"] < 100, "the request stopped early"
        assert after["tandem:request_errors_total{reason=client_disconnected}"] == 1


def test_client_disconnect_while_waiting_aborts(model_dir):
    config = server_config(model_dir)
    with running_server(config, engine_factory=_slow_engine(config, step_delay_s=0.02)) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.url}/v1/completions", timeout=0.5,
                       json={"prompt": "def main():", "max_tokens": 400, "ignore_eos": True})
        assert _wait_for(lambda: scrape(srv.url)["tandem:kv_blocks_used"] == 0, 5.0)
        assert scrape(srv.url)["tandem:generation_tokens_total"] < 200
        assert scrape(srv.url)["tandem:request_errors_total{reason=client_disconnected}"] == 1


def test_full_queue_answers_429_then_drains(model_dir):
    config = server_config(model_dir, max_queued_requests=2, max_num_seqs=1)
    with running_server(config, engine_factory=_slow_engine(config, step_delay_s=0.01)) as srv:
        async def burst():
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def one(i):
                    t0 = time.monotonic()
                    r = await c.post("/v1/completions", json={"prompt": f"x{i}", "max_tokens": 20,
                                                              "ignore_eos": True})
                    return r, time.monotonic() - t0

                return await asyncio.gather(*(one(i) for i in range(8)))

        results = asyncio.run(burst())
        rejected = [(r, dt) for r, dt in results if r.status_code == 429]
        served = [(r, dt) for r, dt in results if r.status_code == 200]
        assert len(rejected) + len(served) == 8
        assert 1 <= len(rejected) <= 6 and len(served) >= 2
        for r, dt in rejected:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            assert dt < min(d for _, d in served), "a 429 comes at once"
        again = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert again.status_code == 200
        assert scrape(srv.url)["tandem:request_errors_total{reason=queue_full}"] == len(rejected)


def test_engine_failure_fails_requests_and_health(model_dir):
    config = server_config(model_dir)
    with running_server(config, engine_factory=_slow_engine(config, fail_after_steps=3)) as srv:
        body = {"prompt": "def main():", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_error"
        assert httpx.get(f"{srv.url}/health").status_code == 503
        after = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert after.status_code == 503


def test_health_is_503_while_loading(model_dir):
    config = server_config(model_dir)
    srv = ServerThread(create_app(config, engine_factory=_slow_engine(config, load_delay_s=1.5)))
    srv.start(wait_ready=False)
    try:
        loading = httpx.get(f"{srv.url}/health")
        assert (loading.status_code, loading.json()) == (503, {"status": "loading"})
        early = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=30)
        assert early.status_code == 503 and "loading" in early.json()["error"]["message"]
        assert _wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 200, 60)
    finally:
        srv.stop()


def test_api_key(model_dir):
    with running_server(server_config(model_dir, api_key="sesame")) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = httpx.get(f"{srv.url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = httpx.post(f"{srv.url}/v1/completions", headers=headers, json={"prompt": "x"})
            assert r.status_code == 401
            for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
                r = httpx.post(f"{srv.url}{path}", headers=headers, json=body)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{srv.url}/v1/models/{model_dir}", headers=headers).status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
        assert httpx.get(f"{srv.url}/version").status_code == 200
        key = {"Authorization": "Bearer sesame"}
        assert httpx.post(f"{srv.url}/tokenize", headers=key, json={"prompt": "x"}).status_code == 200
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=str(model_dir), prompt="x", max_tokens=2).choices
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_log_requests(model_dir, caplog):
    with running_server(server_config(model_dir, log_requests=True)) as srv, \
            caplog.at_level(logging.INFO, logger="tandem.server"):
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
    messages = [rec.getMessage() for rec in caplog.records]
    assert sum("admitted 2 prompt(s)" in m for m in messages) == 1
    assert sum("finished in" in m and "output tokens [3]" in m for m in messages) == 2
