"""Streaming tool calls: whatever the chunks (one character at a time, random pieces), the
deltas put together give the calls written by hand for each output."""
from __future__ import annotations

import json
import random

import pytest

from tandem.server.tools.forced import NamedCallParser, RequiredCallsParser
from tandem.server.tools.hermes import HermesToolParser
from tandem.server.tools.llama3_json import Llama3JsonToolParser
from tandem.server.tools.stream import ToolCallStream, new_tool_call_id

W = '{"city": "Paris", "days": [1, 2], "note": "a \\"}\\" b"}'
CASES = [
    (HermesToolParser(), "Plain text, <b>no</b> calls < here.", "Plain text, <b>no</b> calls < here.", []),
    (HermesToolParser(), f'Checking.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
     "Checking.\n", [("get_weather", W)]),
    (HermesToolParser(), f'<tool_call>{{"name": "a", "arguments": {W}}}</tool_call>\n'
                         '<tool_call>{"arguments": {}, "name": "b"}</tool_call>', "", [("a", W), ("b", "{}")]),
    (HermesToolParser(), '<tool_call>{"name": "a", "arguments": 12}', "", [("a", "12")]),
    (Llama3JsonToolParser(), f'<|python_tag|>{{"name": "a", "parameters": {W}}}; {{"name": "b", "parameters": {{}}}}',
     "", [("a", W), ("b", "{}")]),
    (Llama3JsonToolParser(), "  <|pyjamas are nice", "  <|pyjamas are nice", []),
    (RequiredCallsParser(), f'[{{"name": "a", "parameters": {W}}}, {{"name": "b", "parameters": {{}}}}]',
     "", [("a", W), ("b", "{}")]),
    (NamedCallParser("f"), W, "", [("f", W)]),
]


def streamed(parser, chunks: list[str]) -> tuple[str, list[tuple[str, str]], set[str]]:
    """Feed the output chunk by chunk; the content, the (name, arguments) of each call as the
    deltas build them, and the ids sent."""
    stream = ToolCallStream(parser)
    content, names, arguments, ids = "", [], [], set()
    text = ""
    for i, chunk in enumerate(chunks):
        text += chunk
        piece, deltas = stream.update(text, final=i == len(chunks) - 1)
        content += piece
        for delta in deltas:
            if delta.id is not None:
                assert delta.index == len(names) and delta.type == "function" and delta.function.name
                ids.add(delta.id)
                names.append(delta.function.name)
                arguments.append(delta.function.arguments or "")
            else:
                assert delta.function.name is None and delta.index < len(names)
                arguments[delta.index] += delta.function.arguments
    return content, list(zip(names, arguments)), ids


def splits(text: str, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    chars = list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    randomly = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return [chars, randomly, [text]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_deltas_concatenate_to_the_calls(case, seed):
    parser, text, content, calls = CASES[case]
    for chunks in splits(text, seed):
        got_content, got_calls, ids = streamed(parser, chunks)
        assert (got_content, got_calls) == (content, calls), chunks
        assert len(ids) == len(calls)
        for _, arguments in got_calls:
            json.loads(arguments)


def test_the_stream_gives_what_the_whole_output_parses_to():
    for parser, text, _, _ in CASES:
        final = parser.parse(text, final=True)
        content, calls, _ = streamed(parser, list(text))
        assert (content, calls) == (final.content, [(c.name, c.arguments) for c in final.calls])


def test_a_malformed_call_after_one_was_sent_stops_the_stream():
    stream = ToolCallStream(HermesToolParser())
    _, first = stream.update('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>', False)
    assert [d.function.name for d in first] == ["a"]
    assert stream.update('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops', False) == ("", [])
    assert stream.update('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops{}', True) == ("", [])
    assert stream.num_calls == 1


def test_calls_past_max_calls_are_not_sent():
    text = '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"x": 1}}]'
    stream = ToolCallStream(RequiredCallsParser(), max_calls=1)
    sent = [d for i in range(1, len(text) + 1) for d in stream.update(text[:i], i == len(text))[1]]
    assert [d.function.name for d in sent if d.id] == ["a"] and {d.index for d in sent} == {0}


def test_malformed_text_before_any_call_streams_as_content():
    text = "<tool_call>not a call</tool_call>"
    assert streamed(HermesToolParser(), list(text))[:2] == (text, [])


def test_ids_are_unique_and_vllm_shaped():
    ids = {new_tool_call_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("chatcmpl-tool-") and len(i) == len("chatcmpl-tool-") + 32 for i in ids)
