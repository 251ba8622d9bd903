"""The JSON-object recognizer against Python's json module: every prefix of a document json.dumps
writes is accepted and the whole reaches ``complete``; whatever it accepts as complete,
json.loads parses to a dict (random mutations of valid documents); hand-picked edge cases."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.sched.json_grammar import MAX_WHITESPACE, START, advance

scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.text(max_size=8) | \
    st.floats(allow_nan=False, allow_infinity=False)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                      st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
documents = st.dictionaries(st.text(max_size=6), values, max_size=5)


@settings(max_examples=300, deadline=None)
@given(documents, st.booleans(), st.booleans())
def test_every_prefix_of_a_document_is_accepted(doc, ascii_only, spaced):
    text = json.dumps(doc, ensure_ascii=ascii_only, separators=(", ", ": ") if spaced else (",", ":"))
    data = text.encode()
    state = START
    for i in range(len(data)):
        state = advance(state, data[i:i + 1])
        assert state is not None, (text, i)
        assert state.complete == (i == len(data) - 1)


@settings(max_examples=500, deadline=None)
@given(documents, st.data())
def test_whatever_completes_is_a_json_object(doc, data):
    raw = bytearray(json.dumps(doc).encode())
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw)))
        op = data.draw(st.sampled_from(["insert", "delete", "replace"]))
        byte = data.draw(st.sampled_from(list(b'{}[]",:-+.0123456789eEtrufalsn \\x')))
        if op == "insert":
            raw.insert(at, byte)
        elif at < len(raw):
            if op == "delete":
                del raw[at]
            else:
                raw[at] = byte
    state = advance(START, bytes(raw))
    if state is not None and state.complete:
        assert isinstance(json.loads(bytes(raw)), dict)


@pytest.mark.parametrize("text, ok", [
    ('{}', True), ('{"a":1}', True), ('{"a":-0.5e+3}', True), ('{"a":[true,false,null]}', True),
    ('{"a":"\\u00e9\\n"}', True), ('{"a":{"b":[]}}', True), (' {"a" : 1 } ', False),  # nothing after }
    ('[1]', False), ('"a"', False), ('{"a":01}', False), ('{"a":1.}', False), ('{"a":.5}', False),
    ('{"a":tru}', False), ('{a:1}', False), ('{"a":1,}', False), ('{"a"}', False), ('{"a":"\\x"}', False),
    ('{"a":"\x01"}', False), ('{"a":[1,]}', False), ('{"a":1}}', False), ('{"a":-}', False),
])
def test_edge_cases(text, ok):
    state = advance(START, text.encode())
    assert (state is not None and state.complete) == ok, text


def test_whitespace_runs_are_bounded():
    assert advance(START, b"{" + b" " * MAX_WHITESPACE + b"}").complete
    assert advance(START, b"{" + b" " * (MAX_WHITESPACE + 1)) is None
    assert advance(START, b'{"a": "' + b" " * 50 + b'"}').complete  # inside strings: no limit
