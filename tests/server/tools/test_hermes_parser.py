"""The hermes tool parser on hand-written model outputs (the expected calls written by hand)."""
from __future__ import annotations

import pytest

from tandem.interfaces import ParsedToolCall, ToolCallParse
from tandem.server.tools.hermes import HermesToolParser, partial_tag_len

PARSER = HermesToolParser()
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize("text, content, calls", [
    ("It is sunny.", "It is sunny.", []),
    ("", "", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", '{"city": "Paris"}')]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.\n",
     [("get_weather", '{"city": "Paris"}')]),
    (f"<tool_call>{WEATHER}</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {"zone": "CET", "format": [1, {"a": "}"}]}}\n</tool_call>',
     "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET", "format": [1, {"a": "}"}]}')]),
    # the arguments before the name; a last call without its closing tag; text after the calls
    ('<tool_call>{"arguments": {}, "name": "ping"}', "", [("ping", "{}")]),
    (f"<tool_call>{WEATHER}</tool_call> done", "", [("get_weather", '{"city": "Paris"}')]),
    # strings holding tags and braces are data
    ('<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>{"}}</tool_call>', "",
     [("echo", '{"s": "</tool_call>{"}')]),
])
def test_final_parse(text, content, calls):
    assert PARSER.parse(text, final=True) == ToolCallParse(content, tuple(ParsedToolCall(*c) for c in calls))


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call>',                       # no arguments
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',        # a name that is not a string
    '<tool_call>{"name": "f", "arguments": {"a": 1}',              # cut short
    f"<tool_call>{WEATHER}</tool_call><tool_call>[1]</tool_call>",  # one good call, one bad
    f"<tool_call>{WEATHER} trailing</tool_call>",
])
def test_malformed_calls_fall_back_to_content(text):
    assert PARSER.parse(text, final=True) == ToolCallParse(text)


def test_a_partial_tag_is_held_back_while_streaming():
    assert PARSER.parse("Let me <tool_c", final=False) == ToolCallParse("Let me ")
    assert PARSER.parse("Let me <tool_c", final=True) == ToolCallParse("Let me <tool_c")
    assert PARSER.parse("a < b", final=False) == ToolCallParse("a < b")


def test_a_call_streams_its_name_then_its_arguments():
    assert PARSER.parse('Hi<tool_call>{"name": "get_w', final=False) == ToolCallParse("Hi", (ParsedToolCall(None, ""),))
    assert PARSER.parse('Hi<tool_call>{"name": "get_weather", "arguments": {"ci', final=False) == \
        ToolCallParse("Hi", (ParsedToolCall("get_weather", '{"ci'),))


@pytest.mark.parametrize("text, tag, expected", [
    ("abc<to", "<tool_call>", 3), ("abc", "<tool_call>", 0), ("<tool_call", "<tool_call>", 10),
    ("x<", "<tool_call>", 1), ("<tool_call>", "<tool_call>", 0),
])
def test_partial_tag_len(text, tag, expected):
    assert partial_tag_len(text, tag) == expected
