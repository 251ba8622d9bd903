"""KV events of a real engine (tiny Llama, 7 usable blocks of 16) against what its prefix cache
did, read with plain ZMQ sockets and decoded with vLLM's own structs (vllm_structs.py).

Oracles: each stored block's hash is the blake2b chain computed here from the prompt's tokens;
the blocks an eviction removes are exactly those a repeated prompt no longer hits
(``num_cached_tokens``); a reset with nothing running clears everything; a subscriber that
comes late gets the same batches from the replay socket, in order, then the end marker.
"""
from __future__ import annotations

import hashlib
from array import array

import msgspec
import pytest
import zmq

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import tiny_model_dir
from tests.kv_events.vllm_structs import vllm_kv_events

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TOPIC = "kv@tiny"


def chain(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """The hashes of the full blocks of ``tokens``: blake2b-128 over the parent's hash (for the
    first block of a salted request: blake2b-128 of the JSON ``[salt, null]``, the client's salt
    beside the engine's KV variant, none for this model) and the block's ids as int64."""
    hashes = []
    parent = None if salt is None else hashlib.blake2b(f'["{salt}", null]'.encode(), digest_size=16).digest()
    for start in range(0, len(tokens) // BLOCK * BLOCK, BLOCK):
        digest = hashlib.blake2b(digest_size=16)
        if parent is not None:
            digest.update(parent)
        digest.update(array("q", tokens[start:start + BLOCK]).tobytes())
        parent = digest.digest()
        hashes.append(parent)
    return hashes


@pytest.fixture(scope="module")
def vllm():
    return vllm_kv_events()


@pytest.fixture(scope="module")
def llm():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=8, num_threads=1,
              **{"kv_events.enabled": True, "kv_events.endpoint": "tcp://127.0.0.1:0",
                 "kv_events.replay_endpoint": "tcp://127.0.0.1:0", "kv_events.topic": TOPIC})
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class Subscriber:
    """A live SUB socket on the engine's publisher, decoding with vLLM's structs."""

    def __init__(self, ctx: zmq.Context, endpoint: str, vllm) -> None:
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)
        self.seqs: list[int] = []

    def events(self, timeout_ms: int = 300) -> list:
        """Every event received until none came for ``timeout_ms``."""
        events = []
        while self.socket.poll(timeout_ms):
            topic, seq, payload = self.socket.recv_multipart()
            assert topic == TOPIC.encode()
            self.seqs.append(int.from_bytes(seq, "big"))
            events += self.decoder.decode(payload).events
        return events


@pytest.fixture(scope="module")
def sub(llm, ctx, vllm):
    subscriber = Subscriber(ctx, llm.engine.kv_events.endpoint, vllm)
    subscriber.events(timeout_ms=300)  # the connection is up once the slow-joiner wait is over
    return subscriber


def stored(events) -> list[bytes]:
    return [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]


def test_a_prompt_stores_its_full_blocks_with_their_tokens(llm, sub, vllm):
    prompt = _prompts(1, [3 * BLOCK + 5])[0]
    llm.generate(prompt, ONE_TOKEN)
    events = sub.events()
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    (event,) = events
    assert event.block_hashes == chain(prompt)
    assert event.parent_block_hash is None and event.token_ids == prompt[:3 * BLOCK]
    assert event.block_size == BLOCK and event.medium == "GPU" and event.lora_id is None
    # a salted prompt's chain starts from its salt; a repeat stores nothing new
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "s"}, ONE_TOKEN)
    llm.generate(prompt, ONE_TOKEN)
    assert stored(sub.events()) == chain(prompt, "s")


def test_an_eviction_removes_exactly_the_blocks_a_repeat_no_longer_hits(llm, sub):
    llm.engine.reset_prefix_cache()
    sub.events()
    first = _prompts(2, [3 * BLOCK + 5])[0]
    llm.generate(first, ONE_TOKEN)
    assert stored(sub.events()) == chain(first)
    other = _prompts(3, [5 * BLOCK + 5])[0]     # 6 of the 7 usable blocks: evicts 2 of first's 3
    llm.generate(other, ONE_TOKEN)
    events = sub.events()
    removed = [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert len(removed) == 2 and stored(events) == chain(other)
    hit = llm.generate(first, ONE_TOKEN)[0].num_cached_tokens
    kept = [h for h in chain(first) if h not in removed]
    assert hit == BLOCK * len(kept) and kept == chain(first)[:len(kept)]


def test_a_reset_clears_everything(llm, sub):
    llm.generate(_prompts(4, [2 * BLOCK])[0], ONE_TOKEN)
    sub.events()
    llm.engine.reset_prefix_cache()
    assert [type(e).__name__ for e in sub.events()] == ["AllBlocksCleared"]
    again = _prompts(4, [2 * BLOCK])[0]
    assert llm.generate(again, ONE_TOKEN)[0].num_cached_tokens == 0


def test_a_late_subscriber_replays_every_batch_in_order(llm, ctx, sub, vllm):
    llm.generate(_prompts(5, [BLOCK + 1])[0], ONE_TOKEN)
    live = sub.events()
    assert live and sub.seqs == list(range(len(sub.seqs)))
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(llm.engine.kv_events.replay_endpoint)
    start = 1
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    seqs, replayed = [], []
    decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)
    while True:
        assert dealer.poll(5000), "no end marker from the replay socket"
        empty, topic, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            assert (empty, topic, payload) == (b"", b"", b"")
            break
        assert topic == TOPIC.encode()
        seqs.append(int.from_bytes(seq, "big"))
        replayed.append(decoder.decode(payload))
    dealer.close(linger=0)
    assert seqs == sub.seqs[start:]
    assert [type(e).__name__ for b in replayed for e in b.events][-len(live):] == [type(e).__name__ for e in live]
    assert all(b.data_parallel_rank == 0 for b in replayed)
