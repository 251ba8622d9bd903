"""AsyncEngine: the LLMEngine in its own thread, driven from asyncio.

Oracles: the offline ``tandem.LLM`` on the same checkpoint and settings (outputs), hand-counted
queue bounds, and the KV pool's own free-block count (aborts free everything)."""
from __future__ import annotations

import asyncio
import time

import pytest

from tandem import LLM, SamplingParams
from tandem.async_engine import AsyncEngine, EngineState, QueueLimits, RequestBatch, RequestStream
from tandem.errors import (
    EngineError,
    EngineUnavailable,
    InvalidRequest,
    QueueFull,
    RequestAbortedByShutdown,
)
from tandem.config import load_config
from tandem.engine import LLMEngine
from tandem.outputs import CompletionOutput, RequestOutput
from tests.helpers.tiny_models import tiny_model_dir

ENGINE = {"num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 256, "num_threads": 1}
PROMPTS = ["def main():", "import os\nimport sys", "class Foo(object):", "    return"]


@pytest.fixture(scope="module")
def model_dir():
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model=model_dir, **ENGINE)


def _factory(model_dir: str, step_delay_s: float = 0.0, fail_after_steps: int | None = None,
             fail_after_admitting: int = 0):
    """An LLMEngine builder; optionally slowed down (to observe streaming and deadlines) or made
    to raise on every step after ``fail_after_steps`` (a fatal engine error), counting only the
    steps taken once it has admitted ``fail_after_admitting`` requests (so that the requests a
    test sends together are all in flight when it fails, however fast the machine)."""

    def build() -> LLMEngine:
        engine = LLMEngine(load_config(overrides={"model.path": model_dir, **ENGINE}))
        real_step = engine.step
        steps = [0]
        admitted: set[str] = set()

        def step():
            admitted.update(engine.request_ids())
            if len(admitted) >= fail_after_admitting:
                steps[0] += 1
            if fail_after_steps is not None and steps[0] > fail_after_steps:
                raise RuntimeError("injected fault")
            if step_delay_s:
                time.sleep(step_delay_s)
            return real_step()

        engine.step = step
        return engine

    return build


async def _started(factory, limits: QueueLimits | None = None, listener=None) -> AsyncEngine:
    engine = AsyncEngine(factory, limits or QueueLimits(), step_listener=listener)
    await engine.start()
    await engine.wait_ready()
    return engine


async def _final(engine: AsyncEngine, prompt, params: SamplingParams):
    outputs = [out async for out in engine.generate(prompt, params)]
    return outputs[-1]


def test_concurrent_outputs_equal_offline_api(model_dir, offline):
    params = [SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12),
              SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=5, logprobs=2)]
    expected = offline.generate(PROMPTS, params)

    async def run():
        engine = await _started(_factory(model_dir))
        try:
            return await asyncio.gather(*(_final(engine, p, sp) for p, sp in zip(PROMPTS, params)))
        finally:
            await engine.shutdown()

    got = asyncio.run(run())
    for want, out in zip(expected, got):
        assert out.finished and out.prompt_token_ids == want.prompt_token_ids
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want.outputs]
        assert [o.text for o in out.outputs] == [o.text for o in want.outputs]
    assert got[3].outputs[0].logprobs is not None
    for lp_got, lp_want in zip(got[3].outputs[0].logprobs, expected[3].outputs[0].logprobs):
        assert lp_got.keys() == lp_want.keys()


def test_outputs_stream_as_tokens_are_sampled(model_dir):
    async def run():
        engine = await _started(_factory(model_dir, step_delay_s=0.02))
        seen = []
        try:
            async for out in engine.generate("def main():", SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True)):
                seen.append((len(out.outputs[0].token_ids), out.finished))
        finally:
            await engine.shutdown()
        return seen

    seen = asyncio.run(run())
    assert [n for n, _ in seen] == list(range(1, 9)), "one output per sampled token"
    assert [f for _, f in seen] == [False] * 7 + [True]


def test_leaving_the_stream_aborts_and_frees_blocks_within_a_step(model_dir):
    steps = []

    async def run():
        engine = await _started(_factory(model_dir, step_delay_s=0.01), listener=steps.append)
        try:
            gen = engine.generate("def main():", SamplingParams(temperature=0, max_tokens=200,
                                                                 ignore_eos=True))
            async for out in gen:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            await gen.aclose()
            steps_at_close = len(steps)
            deadline = time.monotonic() + 5
            while engine.snapshot.kv.num_used_blocks and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            return engine.snapshot, len(steps) - steps_at_close, engine.num_queued_requests
        finally:
            await engine.shutdown()

    snapshot, steps_after, queued = asyncio.run(run())
    assert snapshot.kv.num_used_blocks == 0
    assert snapshot.num_running == 0 and snapshot.num_waiting == 0
    assert steps_after <= 1, "the abort lands before the next step"
    assert queued == 0


def test_queue_full_by_requests_then_drains(model_dir):
    async def run():
        # each step waits 1 s, so no request leaves the queue (its first output) before all are
        # checked, however slowly the tokenizer thread answers on a loaded machine
        engine = await _started(_factory(model_dir, step_delay_s=1.0),
                                QueueLimits(max_requests=2, max_tokens=10_000))
        params = SamplingParams(temperature=0, max_tokens=2)
        try:
            results = await asyncio.gather(*(_final(engine, p, params) for p in PROMPTS[:3]),
                                           return_exceptions=True)
            again = await _final(engine, PROMPTS[2], params)
            return results, again, engine.num_queued_requests
        finally:
            await engine.shutdown()

    results, again, queued = asyncio.run(run())
    assert [type(r).__name__ for r in results] == ["RequestOutput", "RequestOutput", "QueueFull"]
    assert again.finished and queued == 0


def test_queue_full_by_prompt_tokens(model_dir, offline):
    tokenizer = offline.get_tokenizer()
    short = tokenizer.encode("x")
    long = tokenizer.encode("import os\nimport sys\nimport json")

    async def run():
        engine = await _started(_factory(model_dir, step_delay_s=1.0),  # first stays queued while short is checked
                                QueueLimits(max_requests=100, max_tokens=len(long)))
        params = SamplingParams(temperature=0, max_tokens=2)
        try:
            first = await engine.add_request(long, params)  # an empty queue admits any prompt
            with pytest.raises(QueueFull):
                await engine.add_request(short, params)
            async for _ in first:
                pass
            return await _final(engine, short, params)
        finally:
            await engine.shutdown()

    assert asyncio.run(run()).finished


def test_engine_refusal_raises_value_error_and_releases_the_queue(model_dir):
    async def run():
        engine = await _started(_factory(model_dir))
        try:
            with pytest.raises(ValueError, match="max_num_seqs"):
                await engine.add_request("x", SamplingParams(n=9))
            with pytest.raises(ValueError, match="vocabulary"):
                await engine.add_request([10**6], SamplingParams())
            return engine.num_queued_requests
        finally:
            await engine.shutdown()

    assert asyncio.run(run()) == 0


def test_a_batch_is_checked_whole_then_admitted_all_or_none(model_dir, offline):
    """Every prompt is checked before any is queued (a bad third prompt is a refusal, not the
    second's full queue); a full queue closes the prompts already admitted; an id in use is
    refused and the request holding it runs on."""
    params = SamplingParams(temperature=0, max_tokens=3)
    want = offline.generate("def main():", params)[0].outputs[0].token_ids

    async def run():
        engine = await _started(_factory(model_dir, step_delay_s=0.2),
                                QueueLimits(max_requests=1, max_tokens=10_000))
        try:
            with pytest.raises(InvalidRequest) as bad:
                await engine.add_requests(RequestBatch(["a", "b", [10**6]], params, ["x-0", "x-1", "x-2"]))
            with pytest.raises(QueueFull):
                await engine.add_requests(RequestBatch(["a", "b"], params, ["y-0", "y-1"]))
            queued = engine.num_queued_requests
            stream = await engine.add_request("def main():", params, request_id="z")
            refused = 0
            async for out in stream:
                if not out.finished and not refused:  # out of the waiting queue, still running
                    with pytest.raises(ValueError, match="request id 'z' is already in use"):
                        await engine.add_request("class Foo:", params, request_id="z")
                    refused += 1
            return bad.value.param, queued, refused, out
        finally:
            await engine.shutdown()

    param, queued, refused, out = asyncio.run(run())
    assert param == "prompt" and queued == 0 and refused == 1
    assert out.outputs[0].token_ids == want and len(want) == 3


def test_fatal_engine_error_fails_every_request(model_dir):
    async def run():
        engine = await _started(_factory(model_dir, fail_after_steps=3, fail_after_admitting=len(PROMPTS)))
        params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(_final(engine, p, params) for p in PROMPTS), return_exceptions=True),
                timeout=30)
            with pytest.raises(EngineUnavailable):
                await engine.add_request("x", params)
            return results, engine.state
        finally:
            await engine.shutdown()

    results, state = asyncio.run(run())
    assert all(isinstance(r, EngineError) for r in results)
    assert state == EngineState.FAILED


def test_load_failure_is_reported(tmp_path):
    def broken():
        raise FileNotFoundError("no model here")

    async def run():
        engine = AsyncEngine(broken)
        await engine.start()
        with pytest.raises(EngineUnavailable, match="no model here"):
            await engine.wait_ready()
        await engine.shutdown()
        return engine.state

    assert asyncio.run(run()) == EngineState.FAILED


def test_graceful_shutdown_lets_requests_finish(model_dir):
    async def run():
        engine = await _started(_factory(model_dir, step_delay_s=0.01))
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        task = asyncio.ensure_future(_final(engine, "def main():", params))
        await asyncio.sleep(0.05)
        engine.begin_shutdown(timeout_s=30)
        with pytest.raises(EngineUnavailable, match="shutting down"):
            await engine.add_request("x", params)
        out = await task
        await engine.shutdown()
        return out, engine.state

    out, state = asyncio.run(run())
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 10
    assert state == EngineState.STOPPED


def test_graceful_shutdown_aborts_what_outlives_the_deadline(model_dir):
    async def run():
        engine = await _started(_factory(model_dir, step_delay_s=0.01))
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(_final(engine, "def main():", params))
        await asyncio.sleep(0.1)
        await asyncio.wait_for(engine.shutdown(timeout_s=0.1), timeout=10)
        with pytest.raises(RequestAbortedByShutdown):
            await task
        return engine.snapshot

    snapshot = asyncio.run(run())
    assert snapshot.kv.num_used_blocks == 0


def test_an_unread_stream_folds_its_deltas_into_one_output():
    """A reader that falls behind finds one cumulative output, not a queue of copies."""
    async def run():
        stream = RequestStream(engine=None, request_id="r", prompt="p", prompt_token_ids=[1])
        for i in range(1000):
            delta = RequestOutput("r", None, [1], [CompletionOutput(0, f"{i},", [i])], finished=i == 999)
            stream._on_output(delta)
        first = stream.output
        return first, [out async for out in stream]

    first, outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0] is first
    assert first.outputs[0].token_ids == list(range(1000))
    assert first.outputs[0].text == "".join(f"{i}," for i in range(1000))
    assert first.finished and first.prompt == "p"
