"""The llama3_json tool parser on hand-written model outputs."""
from __future__ import annotations

import pytest

from tandem.interfaces import ParsedToolCall, ToolCallParse
from tandem.server.tools.llama3_json import Llama3JsonToolParser

PARSER = Llama3JsonToolParser()


@pytest.mark.parametrize("text, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", '{"city": "Paris"}')]),
    ('\n {"name": "f", "arguments": {"x": 1}}', [("f", '{"x": 1}')]),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": [1, 2]}}',
     [("a", "{}"), ("b", '{"k": [1, 2]}')]),
    ('{"name": "a", "parameters": {}};', [("a", "{}")]),
])
def test_calls(text, calls):
    assert PARSER.parse(text, final=True) == ToolCallParse("", tuple(ParsedToolCall(*c) for c in calls))


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    "",
    "  ",
    'Sure: {"name": "f", "parameters": {}}',          # text first: content, as in vLLM
    '{"answer": 42}',                                   # JSON that is not a call
    '{"name": "f", "parameters": {}} and more',
    '{"name": "f", "parameters": {"a": 1}',             # cut short
    '{"name": "a", "parameters": {}}; {"name": "b"}',   # one good call, one without parameters
    "{not json}",
])
def test_other_outputs_are_content(text):
    assert PARSER.parse(text, final=True) == ToolCallParse(text)


def test_streaming_holds_back_what_may_still_become_a_call():
    assert PARSER.parse("  ", final=False) == ToolCallParse("")
    assert PARSER.parse("<|pyth", final=False) == ToolCallParse("")
    assert PARSER.parse("<|pyx", final=False) == ToolCallParse("<|pyx")
    assert PARSER.parse("Hel", final=False) == ToolCallParse("Hel")
    assert PARSER.parse('{"name": "f", "parameters": {"a"', final=False) == \
        ToolCallParse("", (ParsedToolCall("f", '{"a"'),))
