"""Structured outputs through the offline engine, on a random-weight model, where only
constrained decoding can make an output valid. The oracles are independent of xgrammar:
``jsonschema`` for JSON schemas, Python's ``re`` for regular expressions and for a hand
translation of the EBNF grammar, ``json`` for JSON mode.

Every grammar here has a finite language (bounded strings, arrays and numbers), so every
sequence must end by itself ("stop") well before its max_tokens."""
from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

import tandem
from tandem import LLM, SamplingParams
from tandem.errors import InvalidRequest
from tests.helpers.poison_plugin import installed
from tests.helpers.tiny_models import tiny_model_dir

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "maximum": 99}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}(\.[0-9])?"
CHOICES = ["yes", "no", "naïve \"maybe\""]
EBNF = """root ::= "(" num tail ")"
tail ::= "" | op num | op num op num
op ::= "+" | "*"
num ::= digit | digit digit
digit ::= [0-9]"""
EBNF_ORACLE = r"\(\d{1,2}([+*]\d{1,2}){0,2}\)"


@pytest.fixture(scope="module")
def llm():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=256, num_speculative_tokens=3)
    yield llm
    llm.engine.close()


def _texts(llm, params: list[SamplingParams], prompt: str = "Answer:") -> list[str]:
    outputs = [c for o in llm.generate([prompt] * len(params), params) for c in o.outputs]
    assert [c.finish_reason for c in outputs] == ["stop"] * len(outputs), [c.text for c in outputs]
    return [c.text for c in outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(llm, temperature):
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=400, n=2,
                             structured_outputs={"json": PERSON}) for s in range(4)]
    for text in _texts(llm, params):
        jsonschema.validate(json.loads(text), PERSON)


def test_compact_json_has_no_whitespace_between_tokens(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=400,
                            structured_outputs={"json": json.dumps(PERSON), "disable_any_whitespace": True})
    text = _texts(llm, [params])[0]
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_ebnf(llm, temperature):
    kinds = [{"regex": REGEX}, {"choice": CHOICES}, {"grammar": EBNF}]
    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=120, structured_outputs=k)
              for k in kinds for s in range(3)]
    texts = _texts(llm, params)
    for text in texts[:3]:
        assert re.fullmatch(REGEX, text), text
    for text in texts[3:6]:
        assert text in CHOICES
    for text in texts[6:]:
        assert re.fullmatch(EBNF_ORACLE, text), text


def test_json_mode_gives_objects(llm):
    """JSON mode's language is unbounded (any object): a random model rarely closes it, so this
    asks for many long sequences and checks those that end by themselves."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=480, structured_outputs={"json_object": True})
              for s in range(8)]
    outputs = [o.outputs[0] for o in llm.generate(["Answer in JSON:"] * len(params), params)]
    done = [c.text for c in outputs if c.finish_reason == "stop"]
    assert done, [c.text for c in outputs]
    for text in done:
        assert isinstance(json.loads(text), dict), text
    assert all(c.text.lstrip().startswith("{") for c in outputs)


def test_constrained_and_plain_requests_share_a_batch(llm):
    """A plain request next to constrained ones is the same as alone (greedy)."""
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    alone = llm.generate(["Once upon"], plain)[0].outputs[0].token_ids
    mixed = llm.generate(["Once upon", "Answer:"],
                         [plain, SamplingParams(temperature=0.0, max_tokens=120, structured_outputs={"regex": REGEX})])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)


def test_preempted_sequences_keep_their_grammar():
    """A KV pool too small for the batch preempts sequences (recompute); their grammars go on
    from the outputs they kept."""
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=24, max_num_seqs=8)
    try:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=340, structured_outputs={"json": PERSON})
                  for s in range(8)]
        outputs = llm.generate(["Answer:"] * len(params), params)
        assert sum(o.metrics.get("num_preemptions") or 0 for o in outputs) > 0, [o.metrics for o in outputs[:1]]
        for out in outputs:
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
        assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
    finally:
        llm.engine.close()


@pytest.mark.parametrize("spec, fragment", [
    ({"regex": "(ab"}, "parenthesis"),
    ({"json": {"type": "nonsense"}}, "nonsense"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
])
def test_a_grammar_the_backend_refuses_names_the_problem(llm, spec, fragment):
    with pytest.raises(InvalidRequest) as info:
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert info.value.param == "structured_outputs"
    assert fragment in str(info.value)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spec, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"pattern": "a"}, "structured_outputs"),
])
def test_malformed_structured_outputs_are_refused(spec, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(structured_outputs=spec)
    assert info.value.param == param


GATE = threading.Event()


class _GatedPlugin:
    """A structured-output backend plugin: xgrammar whose compiles wait for ``GATE`` (a
    compile that takes as long as the test wants)."""

    @tandem.hookimpl
    def tandem_register_structured_output_backends(self, register):
        from tandem.plugins.xgrammar_backend import XGrammarBackend

        class Gated(XGrammarBackend):
            name = "gated"

            def compile(self, params):
                assert GATE.wait(60)
                return super().compile(params)

        register("gated", Gated)


BUILT: list[str] = []


class _CountingPlugin:
    """xgrammar, remembering the thread that built each backend."""

    @tandem.hookimpl
    def tandem_register_structured_output_backends(self, register):
        from tandem.plugins.xgrammar_backend import XGrammarBackend

        class Counting(XGrammarBackend):
            name = "counting"

            def __init__(self, *args, **kwargs):
                BUILT.append(threading.current_thread().name)
                super().__init__(*args, **kwargs)

        register("counting", Counting)


def test_the_backend_reads_the_vocabulary_when_the_first_constrained_request_needs_it():
    """Not while the engine starts (it would take a core from the first requests' steps): an
    engine that serves only plain requests never builds it; the first constrained request
    builds it once, on its own thread, and the next ones reuse it."""
    BUILT.clear()
    with installed(_CountingPlugin()):
        llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, structured_output_backend="counting")
    try:
        time.sleep(0.2)  # room for a build started with the engine (the old way) to show
        plain = llm.generate(["Once upon"], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(plain[0].outputs[0].token_ids) == 4 and BUILT == []
        params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": "(yes|no)"})
        for _ in range(2):
            out = llm.generate(["Answer:"], params)[0].outputs[0]
            assert out.text in ("yes", "no")
        assert BUILT == [threading.current_thread().name]
    finally:
        llm.engine.close()


def test_a_request_waits_for_its_grammar_outside_the_step():
    """While a grammar compiles, the other requests step on; the constrained request holds no
    blocks, then runs once its grammar is ready. Aborting one that waits frees it."""
    GATE.clear()
    with installed(_GatedPlugin()):
        llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64, structured_output_backend="gated")
    engine = llm.engine
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]}
        constrained = engine.add_request("Answer:", SamplingParams(temperature=0.0, max_tokens=200,
                                                                   structured_outputs={"json": schema}))
        doomed = engine.add_request("Answer:", SamplingParams(max_tokens=5, structured_outputs={"regex": "x+"}))
        plain = engine.add_request("Once upon", SamplingParams(temperature=0.0, max_tokens=6))
        finished = {}
        for _ in range(6):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert plain in finished and constrained not in finished
        assert engine.scheduler.kv.stats().num_used_blocks == 0
        aborted = engine.abort_request(doomed)
        assert aborted[0].outputs[0].finish_reason == "abort"
        GATE.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        out = finished[constrained].outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
        assert doomed not in finished
    finally:
        GATE.set()
        engine.close()


def test_ignore_eos_goes_on_unconstrained_after_the_grammar_ends(llm):
    """With ignore_eos the sequence passes its grammar's stop token and runs to max_tokens: the
    output starts with a complete answer of the grammar, EOS, then free text."""
    out = llm.generate(["Answer:"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                   skip_special_tokens=False,
                                                   structured_outputs={"choice": ["yes", "no"]}))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 30
    eos = sorted(llm.engine.eos_token_ids)
    first_eos = next(i for i, t in enumerate(out.token_ids) if t in eos)
    answer = llm.get_tokenizer().decode(out.token_ids[:first_eos])
    assert answer in ("yes", "no")
