"""Disaggregated prefill/decode inside one process: a prefill engine and a decode engine joined by
the loopback connector (pure engine, no HTTP). The oracle is HF transformers' greedy ``generate``
on the same checkpoint: the decode engine's output, built on the prefill engine's KV, must equal
it token for token. Block accounting is checked against hand-computed counts.
"""
from __future__ import annotations

import time

import pytest

from tandem.config import load_config
from tandem.engine import LLMEngine
from tandem.kv_transfer import RemotePrefill
from tandem.sched.sampling_params import SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts, hf_greedy
from tests.helpers.tiny_models import tiny_model_dir

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_TOKENS = 6


def make_engine(role: str, **overrides) -> LLMEngine:
    values = {
        "model.path": str(tiny_model_dir("llama")),
        "engine.num_kv_blocks": NUM_BLOCKS,
        "engine.block_size": BLOCK_SIZE,
        "disaggregation.role": role,
        "disaggregation.kv_connector": "loopback",
    }
    values.update(overrides)
    return LLMEngine(load_config(overrides=values, env={}))


@pytest.fixture
def pair():
    prefill, decode = make_engine("prefill"), make_engine("decode")
    yield prefill, decode
    prefill.close()
    decode.close()


def run_until_finished(engine: LLMEngine, request_id: str, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError(f"{request_id} did not finish within {timeout_s} s")


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prefill_prompt(prefill: LLMEngine, prompt: list[int], request_id: str = "p") -> RemotePrefill:
    prefill.add_request(prompt, greedy(1), request_id=request_id, remote_decode=True)
    out = run_until_finished(prefill, request_id)
    handshake = prefill.kv_transfer.connector.handshake_info()
    return RemotePrefill.from_params(out.kv_transfer_params, handshake)


def decode_prompt(decode: LLMEngine, prompt: list[int], remote: RemotePrefill, request_id: str = "d"):
    decode.add_request(prompt, greedy(), request_id=request_id, remote_prefill=remote)
    return run_until_finished(decode, request_id).outputs[0].token_ids


def used_blocks(engine: LLMEngine) -> int:
    return engine.scheduler.kv.stats().num_used_blocks


@pytest.mark.parametrize("length", [1, 3, BLOCK_SIZE, BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 2])
def test_decode_on_remote_kv_matches_hf(pair, length):
    prefill, decode = pair
    prompt = _prompts(7, [length])[0]
    remote = prefill_prompt(prefill, prompt)
    assert remote.num_tokens == length
    assert used_blocks(prefill) == -(-length // BLOCK_SIZE)  # pinned until the decode side reads
    got = decode_prompt(decode, prompt, remote)
    assert got == hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    num_read = -(-(length - 1) // BLOCK_SIZE)
    assert decode.kv_transfer.stats().bytes_total == num_read * decode.kv_transfer.block_bytes
    prefill.poll_kv_transfers()
    assert used_blocks(prefill) == 0 and used_blocks(decode) == 0
    assert prefill.kv_transfer.stats().pending_release_blocks == 0


def test_decode_prefix_hits_read_only_the_missing_blocks(pair):
    prefill, decode = pair
    shared = _prompts(8, [3 * BLOCK_SIZE])[0]
    decode.add_request(shared + [5], greedy(1), request_id="warm")
    run_until_finished(decode, "warm")
    prompt = shared + _prompts(9, [2 * BLOCK_SIZE + 1])[0]
    remote = prefill_prompt(prefill, prompt)
    got = decode_prompt(decode, prompt, remote)
    assert got == hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    # 21 tokens: positions 0..19 come from KV; 12 were cached locally, so blocks 3 and 4 are read
    assert decode.kv_transfer.stats().bytes_total == 2 * decode.kv_transfer.block_bytes
    prefill.poll_kv_transfers()
    assert used_blocks(prefill) == 0 and used_blocks(decode) == 0


def test_dead_prefill_recomputes_under_recompute_policy(pair):
    prefill, decode = pair
    prompt = _prompts(10, [3 * BLOCK_SIZE + 2])[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.close()  # a dead peer: the read fails with error:peer
    got = decode_prompt(decode, prompt, remote)
    assert got == hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    assert dict(decode.kv_transfer.stats().failures) == {"peer": 1}
    assert used_blocks(decode) == 0


def test_dead_prefill_fails_the_request_under_fail_policy():
    prefill = make_engine("prefill")
    decode = make_engine("decode", **{"disaggregation.kv_load_failure_policy": "fail"})
    prompt = _prompts(11, [2 * BLOCK_SIZE + 1])[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.close()
    decode.add_request(prompt, greedy(), request_id="d", remote_prefill=remote)
    for _ in range(5):
        decode.step()
    failed = decode.take_failed_requests()
    assert [rid for rid, _ in failed] == ["d"] and "peer" in failed[0][1]
    assert not decode.has_unfinished_requests() and used_blocks(decode) == 0
    decode.close()


def test_frozen_prefill_hits_the_deadline_then_recomputes():
    prefill = make_engine("prefill")
    decode = make_engine("decode", **{"disaggregation.kv_transfer_timeout_s": 0.2})
    prompt = _prompts(12, [2 * BLOCK_SIZE + 3])[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.kv_transfer.connector.pause()
    start = time.monotonic()
    got = decode_prompt(decode, prompt, remote)
    assert time.monotonic() - start >= 0.2
    assert got == hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    assert dict(decode.kv_transfer.stats().failures) == {"deadline": 1}
    assert used_blocks(decode) == 0
    prefill.close()
    decode.close()


def test_abort_during_a_read_keeps_the_blocks_until_the_read_ends():
    prefill = make_engine("prefill")
    decode = make_engine("decode", **{"disaggregation.kv_transfer_timeout_s": 0.2})
    prompt = _prompts(13, [3 * BLOCK_SIZE + 1])[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.kv_transfer.connector.pause()
    decode.add_request(prompt, greedy(), request_id="d", remote_prefill=remote)
    decode.step()  # admitted, read started (and stuck)
    assert used_blocks(decode) == 3
    decode.abort_request("d")
    assert used_blocks(decode) == 3  # a one-sided read may still write into them
    assert decode.has_unfinished_requests()
    deadline = time.monotonic() + 5
    while decode.has_unfinished_requests() and time.monotonic() < deadline:
        decode.step()
    assert used_blocks(decode) == 0
    prefill.close()
    decode.close()


def test_unclaimed_pins_expire():
    prefill = make_engine("prefill", **{"disaggregation.kv_expiry_s": 0.2})
    prompt = _prompts(14, [2 * BLOCK_SIZE])[0]
    prefill_prompt(prefill, prompt)
    assert used_blocks(prefill) == 2
    assert prefill.has_kv_pins()
    time.sleep(0.25)
    prefill.poll_kv_transfers()
    assert used_blocks(prefill) == 0 and not prefill.has_kv_pins()
    assert dict(prefill.kv_transfer.stats().failures) == {"expired": 1}
    prefill.close()


def test_aborted_decode_request_releases_the_prefill_pin_before_admission(pair):
    prefill, decode = pair
    prompt = _prompts(15, [2 * BLOCK_SIZE])[0]
    remote = prefill_prompt(prefill, prompt)
    decode.add_request(prompt, greedy(), request_id="d", remote_prefill=remote)
    decode.abort_request("d")
    prefill.poll_kv_transfers()
    assert used_blocks(prefill) == 0 and used_blocks(decode) == 0


def test_compat_mismatch_is_refused_naming_both_hashes(pair):
    prefill, _ = pair
    other = make_engine("decode", **{"engine.block_size": 8})
    prompt = _prompts(16, [9])[0]
    remote = prefill_prompt(prefill, prompt)
    with pytest.raises(ValueError) as excinfo:
        other.add_request(prompt, greedy(), request_id="d", remote_prefill=remote)
    assert remote.compat_hash in str(excinfo.value)
    assert other.kv_compat_hash() in str(excinfo.value)
    assert not other.has_unfinished_requests()
    other.close()


def test_colocated_engine_refuses_kv_transfer_params():
    engine = make_engine("both")
    assert engine.kv_transfer is None
    with pytest.raises(ValueError, match="colocated"):
        engine.add_request([1, 2, 3], greedy(), remote_decode=True)


def test_prompt_that_differs_from_the_prefilled_one_is_recomputed(pair):
    prefill, decode = pair
    prompt = _prompts(17, [10])[0]
    remote = prefill_prompt(prefill, prompt)
    longer = prompt + [7]
    expected = hf_greedy(tiny_model_dir("llama"), [longer], MAX_TOKENS)[0]
    assert decode_prompt(decode, longer, remote) == expected
    assert dict(decode.kv_transfer.stats().failures) == {"mismatch": 1}
    prefill.poll_kv_transfers()  # the decode side told the prefill side it will not read
    assert used_blocks(prefill) == 0 and used_blocks(decode) == 0
