"""The mp executor's pipe to rank 0 carries one request and its reply at a time: KV connector
calls from another thread (a test, a metrics reader) beside the engine's steps each get their
own reply. The oracle is the type of each reply (counters are ``KVReadCounters``, a handshake a
dict) and the single-process engine's greedy tokens."""
from __future__ import annotations

import threading

import pytest

from tandem import LLM, SamplingParams
from tandem.interfaces import KVReadCounters
from tests.helpers.tiny_models import tiny_model_dir

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


def test_connector_calls_from_another_thread_never_take_a_steps_reply():
    prompts = [[5, 6, 7, 8 + i] for i in range(4)]
    one = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64)
    try:
        expected = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    finally:
        one.engine.close()
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, tensor_parallel_size=2)
    executor = llm.engine.executor
    try:
        connector = executor.connect_kv("loopback", "channel-test")
        stop, seen, errors = threading.Event(), [], []

        def read_beside_the_steps():
            try:
                while not stop.is_set():
                    counters = connector.read_counters()
                    handshakes = executor.call_ranks("handshake_info", [()] * 2)
                    seen.append((counters, handshakes))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        reader = threading.Thread(target=read_beside_the_steps)
        reader.start()
        try:
            for _ in range(3):
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
                assert got == expected
        finally:
            stop.set()
            reader.join(30)
        assert not errors, errors
        assert len(seen) > 5
        for counters, handshakes in seen:
            assert len(counters) == 2 and all(isinstance(c, KVReadCounters) for c in counters)
            assert [type(h) for h in handshakes] == [dict, dict]
    finally:
        llm.engine.close()
