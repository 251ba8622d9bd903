"""No request can take the server down: a request that makes the model raise fails alone with a
500 naming it (streamed: an error event, then ``[DONE]``) while the others are answered as the
offline API answers them; an engine that cannot go on makes ``tandem serve`` exit non-zero.

The poison is a test-only model plugin (tests/helpers/poison_plugin.py); the oracle is the
offline ``tandem.LLM`` on the clean checkpoint with the same engine settings."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tandem import SamplingParams
from tests.helpers.poison_plugin import POISON_TOKEN, installed, poison_model_dir
from tests.server.server_helpers import running_server, scrape, server_config

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def poison_dir(model_dir, tmp_path_factory):
    return poison_model_dir(model_dir, tmp_path_factory.mktemp("poison") / "model")


def _clean_prompts(offline) -> list[list[int]]:
    prompts = [offline.get_tokenizer().encode(text) for text in
               ("def main():", "import os", "class Foo:", "for i in range(10):", "x = [", "return")]
    assert all(POISON_TOKEN not in p for p in prompts)
    return prompts


async def _complete(client: httpx.AsyncClient, prompt, stream: bool) -> tuple[int, object]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.json()
    async with client.stream("POST", "/v1/completions", json=body) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    return r.status_code, events


def test_a_poison_request_gets_a_500_and_the_others_their_answers(poison_dir, offline):
    clean = _clean_prompts(offline)
    poison = clean[0][:2] + [POISON_TOKEN] + clean[0][2:]
    want = [o.outputs[0].text for o in offline.generate(
        clean, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS))]

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            jobs = [_complete(client, p, stream=i % 2 == 1) for i, p in enumerate(clean)]
            jobs += [_complete(client, poison, stream=False), _complete(client, poison, stream=True)]
            return await asyncio.gather(*jobs)

    with installed(), running_server(server_config(poison_dir, served_model_name="tiny")) as srv:
        results = asyncio.run(run(srv.url))
        metrics = scrape(srv.url)
        health = httpx.get(f"{srv.url}/health").status_code
    *answers, (plain_status, plain), (stream_status, events) = results
    for (status, body), text, stream in zip(answers, want, [i % 2 == 1 for i in range(len(clean))]):
        assert status == 200
        if stream:
            assert events_text(body) == text
        else:
            assert body["choices"][0]["text"] == text
    assert plain_status == 500
    error = plain["error"]
    assert error["code"] == "engine_exception" and error["type"] == "internal_server_error"
    # the body names an error id, never the exception's text (the server's log has it)
    assert "poisoned input" not in error["message"] and "error id" in error["message"]
    assert stream_status == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_exception"
    assert metrics["tandem:request_errors_total{reason=engine_exception}"] == 2
    assert metrics["tandem:kv_blocks_used"] == 0
    assert health == 200


def events_text(events: list[str]) -> str:
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])


LAUNCH = """
import sys
from tandem.plugin_manager import get_plugin_manager
import tests.helpers.poison_plugin as poison
get_plugin_manager().register(poison, name="test-poison")
from tandem.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def test_an_engine_that_cannot_go_on_makes_serve_exit_non_zero(model_dir, tmp_path):
    """Every forward pass raises: each request fails alone (500) until the engine gives up;
    then the process stops admitting and exits 1 instead of answering 503 forever."""
    broken = poison_model_dir(model_dir, tmp_path / "broken", "BrokenLlamaForCausalLM")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(broken), "--port", str(port),
                             "--num-kv-blocks", "64", "--max-num-seqs", "4"], cwd=REPO,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        statuses = []
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.post(f"{url}/v1/completions", timeout=30,
                                           json={"prompt": "x", "max_tokens": 2}).status_code)
            except httpx.TransportError:
                break
        code = proc.wait(timeout=30)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1
    assert statuses and set(statuses) <= {500, 503}, statuses
    assert "engine steps failed in a row" in stderr and "the engine failed, exiting" in stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the server did not become ready")
