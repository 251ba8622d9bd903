"""Disaggregated prefill/decode with tensor and pipeline parallelism, split alike or not: every
rank registers its slice of the KV pool with NIXL (UCX between the worker processes) and each
decode rank reads exactly the layers and KV heads it holds from the prefill ranks that hold them
— tp 2 → 2, tp 2 → 1, tp 1 → 2, pp 2 → tp 1, and the one-KV-head model whose head is replicated
on both ranks (tp 2 → 1, tp 1 → 2). The oracle is the colocated single-process server's greedy
answer on the same checkpoint; no block is left behind on either side, and the decode ranks'
connector counters show each read exactly its own heads' bytes."""
from __future__ import annotations

from contextlib import ExitStack

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import tiny_model_dir
from tests.router.instances import wait_for
from tests.server.server_helpers import running_server, server_config
from tests.server.test_disagg import body, decode_answer, hand_over, token_ids

pytest.importorskip("nixl_cu12", reason="the nixl KV connector needs nixl-cu12")
pytestmark = pytest.mark.timeout(300)

LENGTHS = (5, 16, 67)
# the tiny Llama's KV per block: 2 layers × K/V × 16 tokens × 2 KV heads × head_dim 16 × 4 bytes
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _role(model_dir, role: str, tp: int = 1, pp: int = 1, **overrides):
    return server_config(model_dir, served_model_name="tiny", **{
        "disaggregation.role": role, "disaggregation.kv_connector": "nixl",
        "disaggregation.allow_insecure_no_secret": True, "parallel.tensor_parallel_size": tp,
        "parallel.pipeline_parallel_size": pp, "engine.worker_timeout_s": 120, **overrides})


class Instances:
    """Servers of this module, started on first use and stopped at its end: ``get(model, role,
    tp, pp)``."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack, self._running = stack, {}

    def get(self, model, role: str, tp: int = 1, pp: int = 1, **overrides):
        key = (str(model), role, tp, pp, *sorted(overrides.items()))
        if key not in self._running:
            config = server_config(model, served_model_name="tiny") if role == "both" else \
                _role(model, role, tp, pp, **overrides)
            self._running[key] = self._stack.enter_context(running_server(config))
        return self._running[key]


@pytest.fixture(scope="module")
def instances():
    with ExitStack() as stack:
        yield Instances(stack)


@pytest.fixture(scope="module")
def prefill_tp2(model_dir, instances):
    return instances.get(model_dir, "prefill", tp=2)


@pytest.fixture(scope="module")
def decode_tp2(model_dir, instances):
    return instances.get(model_dir, "decode", tp=2)


def _used_blocks(srv) -> int:
    return srv.engine._engine.scheduler.kv.stats().num_used_blocks


def _counters(srv):
    return srv.engine._engine.kv_transfer.connector.read_counters()


def _assert_hand_overs_equal_colocated(oracle_url: str, prefill, decode, seed: int) -> list[int]:
    """Each prompt of LENGTHS handed over from ``prefill`` to ``decode`` answers as the oracle;
    returns the blocks each hand-over read; every block is back afterwards."""
    read = []
    for length in LENGTHS:
        prompt = _prompts(seed + length, [length])[0]
        params = hand_over(prefill.url, prompt)
        answer = decode_answer(decode.url, prompt, params)
        assert answer.status_code == 200, answer.text
        oracle = httpx.post(f"{oracle_url}/v1/completions", json=body(prompt), timeout=60).json()
        assert token_ids(answer.json()) == token_ids(oracle)
        assert answer.json()["usage"]["prompt_tokens"] == length
        read.append(-(-(length - 1) // 16))  # blocks of positions 0 .. P-2
    assert wait_for(lambda: _used_blocks(prefill) == 0 and _used_blocks(decode) == 0, 10)
    return read


def test_a_hand_over_between_tp2_instances_equals_colocated(server, prefill_tp2, decode_tp2):
    handshake = httpx.get(f"{prefill_tp2.url}/kv/handshake", timeout=10).json()
    assert handshake["tensor_parallel_size"] == 2 and len(handshake["ranks"]) == 2
    assert len({r["agent_name"] for r in handshake["ranks"]}) == 2
    assert [r["shard"][2:4] for r in handshake["ranks"]] == [[0, 1], [1, 2]]  # one KV head each
    before = _counters(decode_tp2)
    blocks = sum(_assert_hand_overs_equal_colocated(server.url, prefill_tp2, decode_tp2, 40))
    after = _counters(decode_tp2)
    for was, now in zip(before, after):  # whole blocks, rank to rank: one descriptor per block
        assert now.descriptors - was.descriptors == blocks
        assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES // 2


def test_tp2_prefill_hands_over_to_a_tp1_decode(server, model_dir, instances, prefill_tp2):
    decode_tp1 = instances.get(model_dir, "decode")
    before = _counters(decode_tp1)
    blocks = sum(_assert_hand_overs_equal_colocated(server.url, prefill_tp2, decode_tp1, 50))
    (was,), (now,) = before, _counters(decode_tp1)
    # both heads, each from the rank that holds it: a run per (layer, K/V, token) and prefill rank
    assert now.descriptors - was.descriptors == blocks * 2 * 2 * 16 * 2
    assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES


def test_tp1_prefill_hands_over_to_a_tp2_decode_each_rank_reading_its_head(server, model_dir, instances,
                                                                           decode_tp2):
    prefill_tp1 = instances.get(model_dir, "prefill")
    before = _counters(decode_tp2)
    blocks = sum(_assert_hand_overs_equal_colocated(server.url, prefill_tp1, decode_tp2, 60))
    for was, now in zip(before, _counters(decode_tp2)):
        assert now.descriptors - was.descriptors == blocks * 2 * 2 * 16
        assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES // 2  # its head only


def test_a_streamed_tp1_prefill_hands_over_to_a_tp2_decode(server, model_dir, instances, decode_tp2):
    """disaggregation.stream_kv, a prefill step of 8 tokens: each decode rank reads its head
    from each announced run of blocks, the same bytes as a whole hand-over."""
    prefill_tp1 = instances.get(model_dir, "prefill", **{"disaggregation.stream_kv": True,
                                                         "engine.max_num_batched_tokens": 8})
    # 12 prefill steps: the server answers at admission, before the prompt is done (a prompt
    # done before the server takes its answer is handed over whole, without "stream")
    given_up = hand_over(prefill_tp1.url, _prompts(64, [96])[0])
    assert given_up["stream"] is True and given_up["block_ids"] == []
    assert httpx.post(f"{prefill_tp1.url}/kv/release", json={"transfer_id": given_up["transfer_id"]},
                      timeout=10).json()["released"] is True
    before = _counters(decode_tp2)
    blocks = sum(_assert_hand_overs_equal_colocated(server.url, prefill_tp1, decode_tp2, 65))
    for was, now in zip(before, _counters(decode_tp2)):
        assert now.descriptors - was.descriptors == blocks * 2 * 2 * 16
        assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES // 2  # its head only


def test_pp2_prefill_hands_over_to_a_tp1_decode(server, model_dir, instances):
    prefill_pp2, decode_tp1 = instances.get(model_dir, "prefill", pp=2), instances.get(model_dir, "decode")
    handshake = httpx.get(f"{prefill_pp2.url}/kv/handshake", timeout=10).json()
    assert [r["shard"][:2] for r in handshake["ranks"]] == [[0, 1], [1, 2]]  # one layer per stage
    before = _counters(decode_tp1)
    blocks = sum(_assert_hand_overs_equal_colocated(server.url, prefill_pp2, decode_tp1, 70))
    (was,), (now,) = before, _counters(decode_tp1)
    assert now.descriptors - was.descriptors == blocks * 2  # one contiguous layer from each stage
    assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES


# ------------------------------------------------------------- one KV head, replicated under tp=2


@pytest.fixture(scope="module")
def mqa_dir():
    return tiny_model_dir("llama_mqa")


def test_the_one_kv_head_model_depends_on_the_early_tokens(mqa_dir, instances):
    """STYLE rule 12: a hand-over that garbled the prompt's KV must change the answer."""
    prompt = _prompts(80, [40])[0]
    changed = [(t + 7) % 400 + 3 for t in prompt[:8]] + prompt[8:]
    colocated = instances.get(mqa_dir, "both")
    answers = [httpx.post(f"{colocated.url}/v1/completions", json=body(p), timeout=60).json()
               for p in (prompt, changed)]
    assert token_ids(answers[0]) != token_ids(answers[1])


def test_a_replicated_kv_head_is_read_from_one_prefill_copy(mqa_dir, instances):
    mqa_colocated, mqa_prefill_tp2 = instances.get(mqa_dir, "both"), instances.get(mqa_dir, "prefill", tp=2)
    mqa_decode_tp1 = instances.get(mqa_dir, "decode")
    before = _counters(mqa_decode_tp1)
    blocks = sum(_assert_hand_overs_equal_colocated(mqa_colocated.url, mqa_prefill_tp2, mqa_decode_tp1, 90))
    (was,), (now,) = before, _counters(mqa_decode_tp1)
    # the one head from prefill rank 0 (rank 1, which holds the same head, is only notified:
    # its pins are released too, as _assert_hand_overs_equal_colocated checked)
    assert now.descriptors - was.descriptors == blocks
    assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES // 2


def test_both_decode_ranks_read_the_replicated_head(mqa_dir, instances):
    mqa_colocated, mqa_prefill_tp1 = instances.get(mqa_dir, "both"), instances.get(mqa_dir, "prefill")
    mqa_decode_tp2 = instances.get(mqa_dir, "decode", tp=2)
    before = _counters(mqa_decode_tp2)
    blocks = sum(_assert_hand_overs_equal_colocated(mqa_colocated.url, mqa_prefill_tp1, mqa_decode_tp2, 100))
    for was, now in zip(before, _counters(mqa_decode_tp2)):
        assert now.bytes_read - was.bytes_read == blocks * TINY_BLOCK_BYTES // 2  # the whole head each


def test_a_peer_whose_ranks_lack_a_kv_head_is_refused_naming_it(model_dir, instances, prefill_tp2):
    """What cannot work is still refused before any read: here a handshake whose ranks both
    claim KV head 0, so that no rank holds head 1 of the tp=1 decode instance's shard."""
    handshake = httpx.get(f"{prefill_tp2.url}/kv/handshake", timeout=10).json()
    handshake["ranks"][1]["shard"][2:4] = [0, 1]
    connector = instances.get(model_dir, "decode").engine._engine.kv_transfer.connector
    with pytest.raises(ValueError, match=r"do not hold every layer and KV head of rank 0's shard "
                                         r"\(layers \[0, 2\), KV heads \[0, 2\)\)"):
        connector.add_peer(handshake)
