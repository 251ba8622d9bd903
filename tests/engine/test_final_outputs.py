"""``LLMEngine.final_outputs_only`` (what ``LLM.generate`` runs with): a step returns a request's
output only once it has finished, and that output is the one the per-step path ends with."""
from __future__ import annotations

import dataclasses

from tandem import LLM, SamplingParams
from tests.helpers.tiny_models import tiny_model_dir


def _run(engine, final_only: bool) -> tuple[list[list[str]], dict]:
    engine.final_outputs_only = final_only
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=1) for m in (3, 7)]
    params.append(SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=5, ignore_eos=True))
    for i, p in enumerate(params):
        engine.add_request([5 + i, 6, 7, 8], p, request_id=f"r{i}")
    per_step, last = [], {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        per_step.append(sorted(o.request_id for o in outs))
        last.update({o.request_id: o for o in outs})
    engine.final_outputs_only = False
    return per_step, last


def _comparable(out) -> dict:
    fields = dataclasses.asdict(out)
    fields.pop("metrics")  # times differ between runs
    return fields


def test_only_finished_outputs_come_and_they_equal_the_per_step_paths_last():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, max_num_seqs=8, num_threads=1)
    every_step, expected = _run(llm.engine, final_only=False)
    final_steps, got = _run(llm.engine, final_only=True)
    assert len(final_steps) == len(every_step)
    assert [ids for ids in final_steps if ids] == [["r0"], ["r2"], ["r1"]]  # 3, 5 and 7 tokens
    assert all(o.finished for o in got.values())
    assert {rid: _comparable(o) for rid, o in got.items()} == {rid: _comparable(o) for rid, o in expected.items()}
