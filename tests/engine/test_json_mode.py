"""JSON mode through the engine: whatever a model samples under it is a prefix of one JSON
object, and a sequence that ends by itself ends on a complete object that json.loads parses to
a dict. A random tiny model at a high temperature wanders through the grammar, so some of its
outputs complete and many do not."""
from __future__ import annotations

import json

from tandem import LLM, SamplingParams
from tandem.sched.json_grammar import START, advance
from tests.helpers.tiny_models import tiny_model_dir, tiny_tokenizer


def test_outputs_are_json_objects_or_prefixes_of_one():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=512, num_speculative_tokens=3)
    prompt = tiny_tokenizer().encode("Answer in JSON:")
    params = [SamplingParams(temperature=3.0, max_tokens=200, seed=s, structured_outputs={"json_object": True})
              for s in range(32)]
    params.append(SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json_object": True}, n=2, seed=9))
    outputs = [c for o in llm.generate([prompt] * len(params), params) for c in o.outputs]
    complete = 0
    for out in outputs:
        assert advance(START, out.text.encode()) is not None, out.text
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
            complete += 1
        else:
            assert out.finish_reason == "length"
    assert complete >= 5
