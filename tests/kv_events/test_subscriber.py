"""The router's side of KV events: ``EventStream`` feeding a ``BlockIndex`` from a publisher this
test plays by hand with plain ZMQ sockets (vLLM's frames, payloads encoded with vLLM's own structs),
so that it can drop batches at will. Oracle: the blocks each scenario leaves cached, written out."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from tandem.kv_events.subscriber import EventStream, StreamAddress
from tandem.kv_events.wire import decode_batch
from tandem.router.kv_index import BlockIndex
from tests.kv_events.vllm_structs import vllm_kv_events

pytestmark = pytest.mark.timeout(60)

def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


END_SEQ = (-1).to_bytes(8, "big", signed=True)
H = [bytes([i]) * 16 for i in range(8)]


class HandPublisher:
    """A PUB socket and a ROUTER socket that replays whatever ``buffer`` holds."""

    def __init__(self, vllm) -> None:
        self.vllm = vllm
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:0")
        self.buffer: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def address(self) -> StreamAddress:
        return StreamAddress(self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                             self.router.getsockopt_string(zmq.LAST_ENDPOINT), "")

    def batch(self, seq: int, *events) -> bytes:
        payload = msgspec.msgpack.encode(self.vllm.KVEventBatch(ts=float(seq), events=list(events)))
        self.buffer[seq] = payload
        return payload

    def stored(self, *hashes):
        return self.vllm.BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                                     token_ids=list(range(16 * len(hashes))), block_size=16,
                                     lora_id=None, medium="GPU", lora_name=None)

    def removed(self, *hashes):
        return self.vllm.BlockRemoved(block_hashes=list(hashes), medium="GPU")

    def send(self, seq: int) -> None:
        self.pub.send_multipart([b"", seq.to_bytes(8, "big"), self.buffer[seq]])

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(50):
                continue
            client, empty, start = self.router.recv_multipart()
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start, "big")):
                self.router.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.ctx.destroy(linger=0)


@pytest.fixture
def publisher():
    hand = HandPublisher(vllm_kv_events())
    yield hand
    hand.close()


def until_applied(publisher: HandPublisher, seq: int, condition) -> bool:
    """Send live batch ``seq`` until ``condition()`` holds (the SUB socket joins late)."""
    def sent_and_holds() -> bool:
        publisher.send(seq)
        return condition()
    return wait_for(sent_and_holds, timeout_s=10)


def test_gaps_are_replayed_lost_batches_drop_the_instance_and_a_restart_starts_over(publisher):
    index = BlockIndex(ttl_s=3600)
    publisher.batch(0, publisher.stored(H[1], H[2]))
    stream = EventStream("a", publisher.address, index)
    try:
        assert wait_for(lambda: index.hit_blocks("a", [H[1], H[2]]) == 2)   # replayed at start
        publisher.batch(1, publisher.removed(H[2]))                          # never sent live
        publisher.batch(2, publisher.stored(H[3]))
        assert until_applied(publisher, 2, lambda: index.hit_blocks("a", [H[3]]) == 1)
        assert index.hit_blocks("a", [H[1], H[2]]) == 1 and stream.num_gaps == 1
        publisher.buffer.pop(1)                      # batch 3 is lost for good: nothing to replay
        publisher.buffer.pop(2)
        publisher.batch(4, publisher.stored(H[4]))
        assert until_applied(publisher, 4, lambda: index.hit_blocks("a", [H[4]]) == 1)
        assert index.hit_blocks("a", [H[1]]) == 0 and index.hit_blocks("a", [H[3]]) == 0
        publisher.buffer.clear()                     # a restarted publisher numbers from 0 again
        publisher.batch(0, publisher.stored(H[5]))
        assert until_applied(publisher, 0, lambda: index.hit_blocks("a", [H[5]]) == 1)
        assert index.num_blocks("a") == 1
    finally:
        stream.close()


def test_entries_expire_and_a_clear_forgets_the_instance():
    now = [0.0]
    index = BlockIndex(ttl_s=10.0, clock=lambda: now[0])
    vllm = vllm_kv_events()

    def batch(*events):  # as a stream hands it over: vLLM's bytes, decoded by tandem
        return decode_batch(msgspec.msgpack.encode(vllm.KVEventBatch(ts=now[0], events=list(events))))

    def stored(*hashes):
        return vllm.BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                                block_size=16, lora_id=None, medium="GPU", lora_name=None)

    index.apply("a", batch(stored(H[1], H[2])))
    index.apply("b", batch(stored(H[1], H[2])))
    now[0] = 5.0
    index.apply("a", batch(stored(H[2])))
    assert index.hit_blocks("a", [H[1], H[2]]) == 2
    now[0] = 12.0                                    # H1 stored at 0 is older than 10 s
    assert index.hit_blocks("a", [H[1], H[2]]) == 0 and index.hit_blocks("a", [H[2]]) == 1
    index.apply("b", batch(vllm.AllBlocksCleared()))
    assert index.hit_blocks("b", [H[2]]) == 0 and index.num_blocks("b") == 0
