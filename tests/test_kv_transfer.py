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
from tandem.kv_transfer import KVTransferReplayed, RemotePrefill
from tandem.sched.scheduler import quarantine_holder_id
from tandem.sampling_params import SamplingParams
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


def test_a_read_past_its_deadline_recomputes_and_holds_its_blocks_until_it_lands():
    prefill = make_engine("prefill")
    decode = make_engine("decode", **{"disaggregation.kv_transfer_timeout_s": 0.2})
    prompt = _prompts(12, [2 * BLOCK_SIZE + 3])[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.kv_transfer.connector.pause()
    start = time.monotonic()
    assert decode_prompt(decode, prompt, remote) == hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    assert time.monotonic() - start >= 0.2
    assert dict(decode.kv_transfer.stats().failures) == {"deadline": 1}
    held = decode.scheduler.kv.get_block_ids(quarantine_holder_id("d"))
    assert len(held) == 3 and used_blocks(decode) == 3
    assert decode.kv_transfer.stats().num_quarantined_blocks == 3
    prefill.kv_transfer.connector.resume()
    decode.poll_kv_transfers()  # the late read lands, then the blocks are free
    assert used_blocks(decode) == 0 and not decode.has_unfinished_requests()
    assert all(decode.scheduler.kv.block_pool.blocks[b].block_hash is None for b in held)
    prefill.close()
    decode.close()


def test_a_late_read_cannot_write_into_another_requests_blocks():
    """Bug: a read cancelled at its deadline gave its blocks back at once, and a frozen prefill
    instance that resumed (UCX over TCP delivers a sent read anyway) wrote into them while
    another request used them."""
    prefill = make_engine("prefill")
    decode = make_engine("decode", **{"disaggregation.kv_transfer_timeout_s": 0.2,
                                      "disaggregation.kv_load_failure_policy": "fail"})
    prompt, other = _prompts(18, [3 * BLOCK_SIZE + 1, 3 * BLOCK_SIZE])
    want = hf_greedy(tiny_model_dir("llama"), [other], MAX_TOKENS)[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.kv_transfer.connector.pause()
    decode.add_request(prompt, greedy(), request_id="d", remote_prefill=remote)
    deadline = time.monotonic() + 5
    while not decode.take_failed_requests() and time.monotonic() < deadline:
        decode.step()  # the read passes its deadline: the request fails
    decode.add_request(other, greedy(), request_id="other")  # the blocks handed out first
    decode.step()
    prefill.kv_transfer.connector.resume()  # ... the read lands in the middle of its decoding
    assert run_until_finished(decode, "other").outputs[0].token_ids == want
    assert used_blocks(decode) == 0 and not decode.has_unfinished_requests()
    prefill.close()
    decode.close()


def test_abort_during_a_read_holds_the_blocks_until_the_read_is_over():
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
    time.sleep(0.3)
    decode.step()  # past the deadline: still held while the peer is frozen
    assert used_blocks(decode) == 3 and decode.has_unfinished_requests()
    prefill.kv_transfer.connector.resume()
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
    assert decode.kv_transfer.stats().bytes_total == 0 and used_blocks(decode) == 0


def test_the_model_reads_its_early_prompt_tokens():
    """The tests below check that KV comes from the right prompt: they mean something only if
    the model's output depends on the first tokens of the prompt (STYLE.md rule 12)."""
    prompt = _prompts(20, [3 * BLOCK_SIZE + 2])[0]
    changed = [prompt[1]] + prompt[1:]
    got = hf_greedy(tiny_model_dir("llama"), [prompt, changed], MAX_TOKENS)
    assert got[0] != got[1]


def test_a_prompt_of_the_same_length_is_not_decoded_on_the_prefilled_kv(pair):
    """Bug: only the length was compared, so another prompt of the same length was decoded on
    the wrong KV, and those blocks entered the prefix cache under the other prompt's hashes."""
    prefill, decode = pair
    prompt = _prompts(21, [3 * BLOCK_SIZE + 2])[0]
    other = [prompt[1]] + prompt[1:]  # same length, another first token
    want = hf_greedy(tiny_model_dir("llama"), [other], MAX_TOKENS)[0]
    remote = prefill_prompt(prefill, prompt)
    assert decode_prompt(decode, other, remote) == want
    assert dict(decode.kv_transfer.stats().failures) == {"mismatch": 1}
    # nothing of the prefilled prompt entered this instance's prefix cache under other's hashes
    decode.add_request(other, greedy(), request_id="again")
    assert run_until_finished(decode, "again").outputs[0].token_ids == want
    assert decode.kv_transfer.stats().bytes_total == 0


def test_a_transfer_id_in_flight_or_used_is_refused_without_disturbing_the_first(pair):
    """Bug: the same kv_transfer_params four times at once left three requests waiting forever
    and their blocks in use."""
    prefill, decode = pair
    prompt = _prompts(22, [3 * BLOCK_SIZE + 1])[0]
    want = hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    remote = prefill_prompt(prefill, prompt)
    decode.add_request(prompt, greedy(), request_id="first", remote_prefill=remote)
    for i in range(3):
        with pytest.raises(KVTransferReplayed, match="already been used"):
            decode.add_request(prompt, greedy(), request_id=f"replay{i}", remote_prefill=remote)
    assert run_until_finished(decode, "first").outputs[0].token_ids == want
    with pytest.raises(KVTransferReplayed):
        decode.add_request(prompt, greedy(), request_id="late-replay", remote_prefill=remote)
    assert not decode.has_unfinished_requests() and used_blocks(decode) == 0
    prefill.poll_kv_transfers()
    assert used_blocks(prefill) == 0


def test_a_dead_prefill_engine_is_forgotten_and_its_restart_is_read_from(pair):
    prefill, decode = pair
    prompt = _prompts(23, [2 * BLOCK_SIZE + 2])[0]
    want = hf_greedy(tiny_model_dir("llama"), [prompt], MAX_TOKENS)[0]
    remote = prefill_prompt(prefill, prompt)
    prefill.close()  # died: its read fails with error:peer
    assert decode_prompt(decode, prompt, remote) == want
    assert remote.engine_id not in decode.kv_transfer._peers
    assert decode.kv_transfer.connector._peers == {}
    restarted = make_engine("prefill")  # a new process: a new engine id and agent
    try:
        again = prefill_prompt(restarted, prompt, request_id="p2")
        assert again.engine_id != remote.engine_id
        assert decode_prompt(decode, prompt, again, request_id="d2") == want
        assert dict(decode.kv_transfer.stats().failures) == {"peer": 1}
        assert decode.kv_transfer.stats().bytes_total > 0
    finally:
        restarted.close()


def test_a_pin_released_unread_is_released_once(pair):
    """The router gives a hand-over up (POST /kv/release): the pin goes at once, and neither a
    later notification nor the expiry releases it a second time."""
    prefill, _ = pair
    prompt = _prompts(24, [2 * BLOCK_SIZE + 1])[0]
    remote = prefill_prompt(prefill, prompt)
    assert used_blocks(prefill) == 3
    assert prefill.kv_transfer.release(remote.transfer_id)
    assert used_blocks(prefill) == 0 and not prefill.has_kv_pins()
    assert not prefill.kv_transfer.release(remote.transfer_id)
    prefill.kv_transfer.connector._notifications.append(remote.transfer_id)  # a late notification
    prefill.poll_kv_transfers()
    assert used_blocks(prefill) == 0 and dict(prefill.kv_transfer.stats().failures) == {}
