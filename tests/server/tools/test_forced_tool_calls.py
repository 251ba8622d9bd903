"""The schemas of tool_choice "required" and a named function (vLLM's shape, written out by
hand here), checked with jsonschema on answers that must pass or fail; and their parsers."""
from __future__ import annotations

import jsonschema
import pytest

from tandem.interfaces import ParsedToolCall, ToolCallParse
from tandem.server.protocol import ChatCompletionTool
from tandem.server.tools.forced import (
    NamedCallParser,
    RequiredCallsParser,
    parameters_schema,
    required_schema,
)

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str, parameters: dict | None = None) -> ChatCompletionTool:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return ChatCompletionTool.model_validate({"type": "function", "function": function})


def test_the_required_schema_has_vllms_shape():
    assert required_schema([tool("get_weather", CITY), tool("ping")]) == {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": CITY},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["ping"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]},
        ]},
    }


@pytest.mark.parametrize("answer, valid", [
    ([{"name": "get_weather", "parameters": {"city": "Paris"}}], True),
    ([{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}], True),
    ([], False),
    ([{"name": "get_weather", "parameters": {}}], False),
    ([{"name": "get_time", "parameters": {}}], False),
    ([{"name": "ping"}], False),
    ({"name": "ping", "parameters": {}}, False),
])
def test_the_required_schema_accepts_exactly_calls_of_the_tools(answer, valid):
    schema = required_schema([tool("get_weather", CITY), tool("ping")])
    assert jsonschema.Draft202012Validator(schema).is_valid(answer) == valid


def test_without_parallel_calls_the_list_holds_one_call():
    schema = required_schema([tool("ping")], single=True)
    assert schema["maxItems"] == 1
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "ping", "parameters": {}}])
    assert not validator.is_valid([{"name": "ping", "parameters": {}}] * 2)


def test_defs_are_hoisted_to_the_root_where_refs_resolve():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    parameters = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
                  "$defs": {"Point": point}}
    schema = required_schema([tool("move", parameters), tool("mark", parameters)])
    assert schema["$defs"] == {"Point": point}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "move", "parameters": {"at": {"x": 1}}}])
    assert not validator.is_valid([{"name": "move", "parameters": {"at": {"y": 1}}}])
    assert "$defs" in parameters  # the request's tool is left as it was


def test_two_definitions_of_one_name_are_refused():
    a = {"type": "object", "$defs": {"P": {"type": "string"}}}
    b = {"type": "object", "$defs": {"P": {"type": "number"}}}
    with pytest.raises(ValueError, match=r"\$defs.P"):
        required_schema([tool("a", a), tool("b", b)])


def test_a_named_function_is_held_to_its_parameters():
    assert parameters_schema(tool("get_weather", CITY)) == CITY
    assert parameters_schema(tool("ping")) == {"type": "object", "properties": {}}


def test_the_named_parser_takes_the_whole_output_as_arguments():
    assert NamedCallParser("f").parse('{"a": 1', final=False) == ToolCallParse("", (ParsedToolCall("f", '{"a": 1'),))


@pytest.mark.parametrize("text, final, expected", [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', True,
     ToolCallParse("", (ParsedToolCall("a", '{"x": 1}'), ParsedToolCall("b", "{}")))),
    (' [ {"parameters": {}, "name": "b"} ] ', True, ToolCallParse("", (ParsedToolCall("b", "{}"),))),
    ('[{"name": "a", "parameters": {"x"', False, ToolCallParse("", (ParsedToolCall("a", '{"x"'),))),
    ("[", False, ToolCallParse("")),
    ("", False, ToolCallParse("")),
    ('[{"name": "a", "parameters": {"x"', True, ToolCallParse('[{"name": "a", "parameters": {"x"')),
    ('[{"name": "a", "parameters": {}}] x', True, ToolCallParse('[{"name": "a", "parameters": {}}] x')),
    ("[]", True, ToolCallParse("[]")),
    ('{"name": "a"}', True, ToolCallParse('{"name": "a"}')),
])
def test_the_required_parser(text, final, expected):
    assert RequiredCallsParser().parse(text, final) == expected
