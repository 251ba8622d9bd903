"""Disaggregated prefill/decode with tensor parallelism on both sides: every rank registers its
slice of the KV pool with NIXL (UCX between the worker processes) and a hand-over moves every
rank's blocks; the decode instance's greedy answer equals the colocated single-process server's
(the oracle), no block is left behind, and a peer split another way is refused at the handshake
with a message naming both sizes."""
from __future__ import annotations

import time

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.server.server_helpers import running_server, server_config
from tests.server.test_disagg import body, decode_answer, hand_over, token_ids

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")
pytestmark = pytest.mark.timeout(300)


def _role(model_dir, role: str, tp: int):
    return server_config(model_dir, served_model_name="tiny", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "nixl",
        "disaggregation.allow_insecure_no_secret": True, "parallel.tensor_parallel_size": tp, "engine.worker_timeout_s": 120})


@pytest.fixture(scope="module")
def prefill_tp2(model_dir):
    with running_server(_role(model_dir, "prefill", 2)) as srv:
        yield srv


@pytest.fixture(scope="module")
def decode_tp2(model_dir):
    with running_server(_role(model_dir, "decode", 2)) as srv:
        yield srv


def _used_blocks(srv) -> int:
    return srv.engine._engine.scheduler.kv.stats().num_used_blocks


def test_a_hand_over_between_tp2_instances_equals_colocated(server, prefill_tp2, decode_tp2):
    handshake = httpx.get(f"{prefill_tp2.url}/kv/handshake", timeout=10).json()
    assert handshake["tensor_parallel_size"] == 2 and len(handshake["ranks"]) == 2
    assert len({r["agent_name"] for r in handshake["ranks"]}) == 2
    for length in (5, 16, 67):
        prompt = _prompts(40 + length, [length])[0]
        params = hand_over(prefill_tp2.url, prompt)
        answer = decode_answer(decode_tp2.url, prompt, params)
        assert answer.status_code == 200, answer.text
        oracle = httpx.post(f"{server.url}/v1/completions", json=body(prompt), timeout=60).json()
        assert token_ids(answer.json()) == token_ids(oracle)
        assert answer.json()["usage"]["prompt_tokens"] == length
    deadline = time.monotonic() + 10
    while (_used_blocks(prefill_tp2) or _used_blocks(decode_tp2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _used_blocks(prefill_tp2) == 0 and _used_blocks(decode_tp2) == 0


def test_a_peer_split_another_way_is_refused_naming_both(model_dir, prefill_tp2):
    with running_server(_role(model_dir, "decode", 1)) as decode_tp1:
        prompt = _prompts(77, [20])[0]
        params = hand_over(prefill_tp2.url, prompt)
        answer = decode_answer(decode_tp1.url, prompt, params)
        assert answer.status_code == 400, answer.text
        assert "tensor_parallel_size" in answer.json()["error"]["message"]
        # and a handshake of the tp=2 instance is refused by the tp=1 connector itself
        handshake = httpx.get(f"{prefill_tp2.url}/kv/handshake", timeout=10).json()
        connector = decode_tp1.engine._engine.kv_transfer.connector
        with pytest.raises(ValueError, match=r"tensor_parallel_size × pipeline_parallel_size = 2 × 1, this instance 1 × 1"):
            connector.add_peer(handshake)
