"""Grammars cannot starve a server's other clients, through a real uvicorn: a small ``choice``
request is answered promptly while eight huge schemas compile, and a grammar past the compile
time limit is a 400 ``grammar_too_complex`` (at once when it comes again). The bound is relative
to baselines measured in the same test: the small request alone, and one huge compile."""
from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tandem.sampling_params import StructuredOutputsParams
from tests.engine.test_grammar_limits import huge_schema
from tests.server.server_helpers import running_server, server_config

TIME_LIMIT_S = 0.1  # a huge schema compiles in 0.3-1 s on a 2-core CI machine: well past it


@pytest.fixture(scope="module")
def server(model_dir):
    config = server_config(model_dir, served_model_name="tiny", grammar_compile_timeout_s=TIME_LIMIT_S)
    with running_server(config) as srv:
        yield srv


def _complete(url: str, structured_outputs: dict, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": max_tokens, "temperature": 0.0,
            "structured_outputs": structured_outputs}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def _small(url: str) -> float:
    """Seconds for a fresh (never cached) two-way choice request; checks its answer."""
    choices = [f"yes-{uuid.uuid4().hex[:6]}", "no"]
    t0 = time.perf_counter()
    response = _complete(url, {"choice": choices})
    elapsed = time.perf_counter() - t0
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] in choices
    return elapsed


def _compile_s(server, schema: dict) -> float:
    backend = server.engine._engine.structured.backend
    t0 = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=schema))
    return time.perf_counter() - t0


def test_a_small_grammar_is_answered_while_huge_ones_compile(server):
    huge = [huge_schema(f"h{i}_") for i in range(8)]
    assert all(len(str(s)) < 65536 for s in huge)
    compile_s = _compile_s(server, huge_schema("b"))
    alone = min(_small(server.url) for _ in range(2))
    with ThreadPoolExecutor(len(huge)) as pool:
        answers = [pool.submit(_complete, server.url, {"json": s}) for s in huge]
        time.sleep(0.5)  # the huge requests are admitted and compiling
        beside = _small(server.url)
        responses = [a.result() for a in answers]
    for r in responses:
        assert r.status_code == 200 or r.json()["error"]["code"] == "grammar_too_complex", r.text
    assert beside < alone + 2 * compile_s, (beside, alone, compile_s)


def test_a_grammar_past_the_time_limit_is_a_400(server):
    schema = huge_schema("slow")
    assert _compile_s(server, huge_schema("sb")) > 2 * TIME_LIMIT_S
    response = _complete(server.url, {"json": schema})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "grammar_too_complex" and "grammar_compile_timeout_s" in error["message"]
    t0 = time.perf_counter()
    again = _complete(server.url, {"json": schema})
    assert again.status_code == 400 and again.json()["error"]["code"] == "grammar_too_complex"
    assert time.perf_counter() - t0 < TIME_LIMIT_S + 0.5 * _compile_s(server, huge_schema("ag"))
    assert _small(server.url) > 0  # the server still answers
