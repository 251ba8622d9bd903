"""Grammars cannot starve the engine's other requests: a compile has a time limit and is dropped
with its request, and a grammar whose work per token passes its budget finishes its request
with an error while the batch goes on. Oracles: the same plain request run alone (its tokens),
and the compile time of the same schema measured on this machine."""
from __future__ import annotations

import time

import pytest

from tandem import LLM, SamplingParams
from tandem.errors import InvalidRequest
from tests.helpers.tiny_models import tiny_model_dir

AMBIGUOUS = 's ::= "a" | s s\nroot ::= s+'
"""Every string of a's has exponentially many parses: the matcher's work grows with every token
(past the budget within a hundred or two)."""


def huge_schema(tag: str, num_properties: int = 1800) -> dict:
    """An object of many optional string properties: a slow compile under the 65,536-character
    cap on a grammar's text."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(num_properties)}}


def _step_until(engine, done, timeout_s: float = 120.0) -> dict:
    finished = {}
    deadline = time.monotonic() + timeout_s
    while not done(finished):
        assert time.monotonic() < deadline, "the engine did not get there in time"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_an_ambiguous_grammar_is_finished_and_the_batch_goes_on():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=256, max_grammar_ms_per_token=10.0,
              num_threads=1)
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
        alone = llm.generate(["Once upon a time"], plain)[0].outputs[0].token_ids
        slow = SamplingParams(temperature=0.0, max_tokens=480, min_tokens=480,
                              structured_outputs={"grammar": AMBIGUOUS})
        outs = llm.generate(["Answer:", "Once upon a time"], [slow, plain])
        constrained, beside = outs[0].outputs[0], outs[1].outputs[0]
        assert constrained.finish_reason == "error"
        assert "engine.max_grammar_ms_per_token" in outs[0].error
        assert set(constrained.text) <= {"a"} and 0 < len(constrained.token_ids) < 480
        assert beside.finish_reason == "length" and beside.token_ids == alone
        assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def one_thread_llm():
    """One large-lane compile thread and a time limit below a huge schema's compile time."""
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, grammar_compile_threads=1,
              grammar_compile_timeout_s=0.05, num_threads=1)
    llm.engine.structured.backend  # the vocabulary is read once, before any timing
    yield llm
    llm.engine.close()


def _compile_s(llm, schema: dict) -> float:
    from tandem.sampling_params import StructuredOutputsParams

    t0 = time.perf_counter()
    llm.engine.structured.backend.compile(StructuredOutputsParams(json=schema))
    return time.perf_counter() - t0


def test_a_grammar_past_the_time_limit_fails_with_a_clear_error(one_thread_llm):
    llm = one_thread_llm
    assert _compile_s(llm, huge_schema("m")) > 4 * llm.config.engine.grammar_compile_timeout_s
    params = SamplingParams(max_tokens=5, structured_outputs={"json": huge_schema("t")})
    out = llm.generate(["Answer:"], params)[0]
    assert out.outputs[0].finish_reason == "error"
    assert "grammar_compile_timeout_s" in out.error and "too complex" in out.error
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequest, match="too complex"):
        llm.generate(["Answer:"], params)
    assert time.perf_counter() - t0 < 0.5 * _compile_s(llm, huge_schema("n"))


def test_an_aborted_compile_is_dropped_and_frees_its_thread(one_thread_llm):
    """The only large-lane thread compiles a huge schema; its request is aborted; another large
    grammar then compiles on a replacement thread while the first compile still runs, and the
    aborted grammar is not kept (asking for it again compiles it again)."""
    llm = one_thread_llm
    engine = llm.engine
    engine.structured.compile_timeout_s = 60.0  # this test aborts before any limit
    deadline = time.monotonic() + 120
    while engine.structured._large.num_live_threads > 1:  # an earlier test's abandoned compile
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        doomed_schema = huge_schema("d")
        doomed = engine.add_request("Answer:", SamplingParams(max_tokens=5, structured_outputs={"json": doomed_schema}))
        job = engine.structured._compiling[doomed]
        while job.started_at is None:
            time.sleep(0.001)
        engine.abort_request(doomed)
        other = engine.add_request("Answer:", SamplingParams(
            max_tokens=3, temperature=0.0, structured_outputs={"json": huge_schema("o", 120)}))
        finished = _step_until(engine, lambda f: other in f)
        assert finished[other].outputs[0].finish_reason in ("stop", "length")
        # Had the other grammar waited for the only thread, the doomed compile would be done by now.
        assert job.abandoned and not job.future.done()
        job.future.exception(timeout=120)
        from tandem.sampling_params import StructuredOutputsParams

        again = engine.structured.submit(StructuredOutputsParams(json=doomed_schema))
        assert not again.future.done()
        engine.structured.drop(again)
    finally:
        engine.structured.compile_timeout_s = llm.config.engine.grammar_compile_timeout_s
