"""What ``[kv_events]`` refuses: an endpoint that is no ZMQ tcp/ipc address (a config error
naming the field), and an address already taken (the publisher says which); and what a full
queue does: the engine thread drops the batch at once, the gap shows in the sequence numbers."""
from __future__ import annotations

import socket

import pytest

from tandem.config import ConfigError, load_config
from tandem.kv_events.publisher import KVEventPublisher, PublisherSettings


@pytest.mark.parametrize("field, value", [("endpoint", "http://127.0.0.1:5557"),
                                          ("replay_endpoint", "tcp://127.0.0.1"),
                                          ("endpoint", "tcp://127.0.0.1:55x")])
def test_an_endpoint_that_is_no_zmq_address_is_a_config_error_naming_it(field, value):
    with pytest.raises(ConfigError, match=f"kv_events.{field}"):
        load_config(overrides={f"kv_events.{field}": value}, env={})


def test_an_address_in_use_is_refused_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        settings = PublisherSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint=endpoint, topic="",
                                     buffer_steps=4, hwm=4, max_queue_size=4, medium="GPU")
        with pytest.raises(OSError, match=f"cannot bind {endpoint}"):
            KVEventPublisher(settings)


def drained(publisher: KVEventPublisher) -> None:
    import time

    deadline = time.monotonic() + 5
    while not publisher._queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_full_queue_drops_batches_without_blocking_and_subscribers_see_the_gap():
    import threading
    import time

    import zmq

    from tandem.sched.kv_events import AllBlocksCleared

    settings = PublisherSettings(endpoint="tcp://127.0.0.1:0", replay_endpoint=None, topic="t",
                                 buffer_steps=16, hwm=100, max_queue_size=2, medium="GPU")
    publisher = KVEventPublisher(settings)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    sub.connect(publisher.endpoint)
    try:
        time.sleep(0.3)                                  # the SUB socket's connection is up
        stuck, encode = threading.Event(), publisher._encoder.encode
        publisher._encoder.encode = lambda ts, events: (stuck.wait(10), encode(ts, events))[1]
        publisher.publish([AllBlocksCleared()])          # seq 0: the publisher thread hangs on it
        drained(publisher)
        start = time.perf_counter()
        for _ in range(4):      # seq 1, 2 queued; 3, 4 dropped at once (the thread hangs 10 s)
            publisher.publish([AllBlocksCleared()])
        assert time.perf_counter() - start < 1.0 and publisher.num_dropped_batches == 2
        stuck.set()
        drained(publisher)
        publisher.publish([AllBlocksCleared()])          # seq 5
        seqs = []
        while len(seqs) < 4 and sub.poll(5000):
            seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert seqs == [0, 1, 2, 5]
    finally:
        ctx.destroy(linger=0)
        publisher.close()
