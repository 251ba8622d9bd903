"""Hand-overs under injected faults, with a prefill and a decode server in this process over the
"faulty" connector wrapping the loopback one, driven over HTTP as the router drives them. The
oracle is the shared colocated server: every answer must equal its greedy answer.

- A read that is reported done with half a block not written (a truncated read) is caught by the
  block checksums the hand-over carries: the decode instance computes the prompt itself. The same
  for a streamed hand-over, whose checksums come with its announcements.
- A prefill instance whose connector restarts with a new agent keeps its engine id and handshake
  URL: the decode instance's first read after it fails ("peer"), and the next hand-over is read
  again from the new agent, its handshake fetched afresh.
"""
from __future__ import annotations

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.router.instances import wait_for
from tests.server.server_helpers import running_server, scrape, server_config
from tests.server.test_disagg import body, decode_answer, hand_over, token_ids

BLOCK = 16
BYTES = "tandem:kv_transfer_bytes_total"


def _role(model_dir, role: str, settings: dict | None = None, **faults):
    return server_config(model_dir, served_model_name="tiny", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "faulty",
        "disaggregation.allow_insecure_no_secret": True, "disaggregation.kv_expiry_s": 2.0,
        "fault_injection.inner_connector": "loopback",
        **{f"fault_injection.{k}": v for k, v in faults.items()}, **(settings or {})})


def oracle_tokens(url: str, prompt: list[int]) -> list[str]:
    return token_ids(httpx.post(f"{url}/v1/completions", json=body(prompt), timeout=60).json())


def failures(url: str, reason: str) -> float:
    return scrape(url).get(f"tandem:kv_transfer_failures_total{{reason={reason}}}", 0.0)


@pytest.mark.timeout(120)
def test_a_truncated_read_is_caught_by_the_checksums_and_recomputed(model_dir, server):
    with running_server(_role(model_dir, "prefill")) as prefill, \
            running_server(_role(model_dir, "decode", truncate_rate=1.0)) as decode:
        prompt = _prompts(50, [3 * BLOCK + 2])[0]
        params = hand_over(prefill.url, prompt)
        assert len(params["kv_checksums"]) == 4
        answer = decode_answer(decode.url, prompt, params)
        assert answer.status_code == 200, answer.text
        assert token_ids(answer.json()) == oracle_tokens(server.url, prompt)
        metrics = scrape(decode.url)
        assert metrics["tandem:kv_transfer_failures_total{reason=checksum}"] == 1
        assert metrics["tandem:kv_blocks_used"] == 0
        assert wait_for(lambda: scrape(decode.url).get(
            "tandem:kv_connector_events_total{event=truncate}") == 1, 5)
        assert wait_for(lambda: scrape(prefill.url)["tandem:kv_blocks_used"] == 0, 5)


@pytest.mark.timeout(120)
def test_a_truncated_streamed_read_is_caught_by_the_announced_checksums(model_dir, server):
    streamed = {"disaggregation.stream_kv": True, "engine.max_num_batched_tokens": 2}
    with running_server(_role(model_dir, "prefill", streamed)) as prefill, \
            running_server(_role(model_dir, "decode", truncate_rate=1.0)) as decode:
        prompt = _prompts(52, [5 * BLOCK + 3])[0]
        params = hand_over(prefill.url, prompt)
        assert params["stream"] is True and "kv_checksums" not in params  # they come announced
        answer = decode_answer(decode.url, prompt, params)
        assert answer.status_code == 200, answer.text
        assert token_ids(answer.json()) == oracle_tokens(server.url, prompt)
        assert scrape(decode.url)["tandem:kv_transfer_failures_total{reason=checksum}"] == 1
        assert scrape(decode.url)["tandem:kv_blocks_used"] == 0
        assert wait_for(lambda: scrape(prefill.url)["tandem:kv_blocks_used"] == 0, 10)


@pytest.mark.timeout(120)
def test_a_restarted_prefill_agent_is_read_again_after_one_failed_read(model_dir, server):
    with running_server(_role(model_dir, "prefill", restart_every_n=1)) as prefill, \
            running_server(_role(model_dir, "decode")) as decode:
        first, second, third = _prompts(51, [2 * BLOCK + 1] * 3)
        agent = httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()["agent_name"]
        assert decode_answer(decode.url, first, hand_over(prefill.url, first)).status_code == 200
        read = scrape(decode.url)[BYTES]
        assert read > 0
        # its notification of the first read restarts the prefill instance's agent
        assert wait_for(lambda: httpx.get(f"{prefill.url}/kv/handshake", timeout=10).json()["agent_name"]
                        != agent, 10)

        answer = decode_answer(decode.url, second, hand_over(prefill.url, second))
        assert answer.status_code == 200 and token_ids(answer.json()) == oracle_tokens(server.url, second)
        assert failures(decode.url, "peer") == 1 and scrape(decode.url)[BYTES] == read

        answer = decode_answer(decode.url, third, hand_over(prefill.url, third))
        assert answer.status_code == 200 and token_ids(answer.json()) == oracle_tokens(server.url, third)
        assert failures(decode.url, "peer") == 1 and scrape(decode.url)[BYTES] == 2 * read
        assert scrape(decode.url)["tandem:kv_blocks_used"] == 0
        assert wait_for(lambda: scrape(prefill.url)["tandem:kv_blocks_pending_release"] == 0, 10)
