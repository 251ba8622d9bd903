"""``tool_choice: "required"`` and a named function, enforced by constrained decoding as in
vLLM: the request's output must match a JSON schema, so any model answers with calls.

- a named function: the output is that function's arguments, one JSON value of its
  ``parameters`` schema (``{"type": "object", "properties": {}}`` when it has none);
- "required": the output is a JSON array, at least one item, each an object
  ``{"name": <one of the tools>, "parameters": <that tool's schema>}``::

      {"type": "array", "minItems": 1,
       "items": {"type": "object", "anyOf": [
           {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                           "parameters": <get_weather's parameters>},
            "required": ["name", "parameters"]}, ...]},
       "$defs": {...}}

  (each tool's ``$defs`` hoisted to the top, since a ``$ref`` resolves from the root; two tools
  defining one name differently are refused; ``"maxItems": 1`` with ``parallel_tool_calls:
  false``).

Their parsers read those outputs back as calls (streamed or not) with the ``ToolParser``
contract; they are not plugins: the request picks them.
"""
from __future__ import annotations

import copy
from typing import Any

from tandem.interfaces import ParsedToolCall, ToolCallParse, ToolParser
from tandem.server.protocol import ChatCompletionTool
from tandem.server.tools.incremental import CallListCursor, ToolCallCursor, WholeTextCall
from tandem.server.tools.json_scan import CallKeys, Malformed, scan_call_list, skip_ws

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_KEYS = CallKeys("name", ("parameters",))


def parameters_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    """The schema of ``tool``'s arguments (a copy)."""
    return copy.deepcopy(tool.function.parameters) if tool.function.parameters else dict(EMPTY_PARAMETERS)


def required_schema(tools: list[ChatCompletionTool], single: bool = False) -> dict[str, Any]:
    """The schema of a "required" answer (see the module docstring), with ``"maxItems": 1``
    when ``single`` (``parallel_tool_calls: false``). Raises ValueError when two tools define
    one ``$defs`` name differently."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = parameters_schema(tool)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise ValueError(f"two tools define $defs.{name} differently; tool_choice "
                                 '"required" needs one definition per name')
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedCallParser(ToolParser):
    """The whole output is the arguments of the one call of function ``function_name``."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ToolCallParse:
        return ToolCallParse("", (ParsedToolCall(self.function_name, text),))

    def cursor(self) -> NamedCallCursor:
        return NamedCallCursor(self.function_name)


class RequiredCallsParser(ToolParser):
    """The output is a JSON array of ``{"name", "parameters"}`` objects."""

    name = "required"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        start = skip_ws(text, 0)
        if start == len(text):
            return ToolCallParse(text if final else "")
        if text[start] != "[":
            return ToolCallParse(text)
        try:
            calls, complete = scan_call_list(text, start + 1, _KEYS, ",", "]")
        except Malformed:
            return ToolCallParse(text)
        if final and not complete:
            return ToolCallParse(text)
        return ToolCallParse("", tuple(calls))

    def cursor(self) -> RequiredCallsCursor:
        return RequiredCallsCursor()


class NamedCallCursor(ToolCallCursor):
    """The whole output is the arguments: nothing to scan."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.calls.append(WholeTextCall(function_name))

    def _scan(self, text: str, final: bool) -> None:
        return


class RequiredCallsCursor(CallListCursor):
    """``RequiredCallsParser.parse`` one character at a time (see
    tandem.server.tools.incremental)."""

    def __init__(self) -> None:
        super().__init__(_KEYS, ",", "]")
        self._mode: str | None = None
        self._start = 0

    def _scan(self, text: str, final: bool) -> None:
        if self._mode is None:
            self._start = start = skip_ws(text, self._start)
            if start == len(text):
                self.content_end = len(text) if final else 0
                return
            self._mode = "calls" if text[start] == "[" else "content"
            if self._mode == "calls":
                self.start_calls(start + 1)
        if self._mode == "content":
            self.content_end = len(text)
            return
        self._scan_list(text, final)
