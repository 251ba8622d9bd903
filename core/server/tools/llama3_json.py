"""The ``llama3_json`` tool parser: Llama 3.1–3.3's JSON tool calls, a whole output of one or
more objects separated by ``;``, possibly after ``<|python_tag|>`` (a special token, in the text
only with ``skip_special_tokens: false``)::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

``parameters`` (or ``arguments``) holds the arguments. An output that starts (after whitespace)
with anything else is content, as in vLLM; so is one whose JSON is not calls. While streaming,
leading whitespace and a start of ``<|python_tag|>`` are held back until the first character
decides.
"""
from __future__ import annotations

from tandem.interfaces import ToolCallParse, ToolParser
from tandem.server.tools.json_scan import CallKeys, Malformed, scan_call_list

PYTHON_TAG = "<|python_tag|>"
_KEYS = CallKeys("name", ("parameters", "arguments"))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        body = text.lstrip()
        start = len(text) - len(body)
        if body.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
        elif not body.startswith("{"):
            undecided = not final and PYTHON_TAG.startswith(body)
            return ToolCallParse("" if undecided else text)
        try:
            calls, complete = scan_call_list(text, start, _KEYS, ";", None)
        except Malformed:
            return ToolCallParse(text)
        if final and not complete:
            return ToolCallParse(text)
        return ToolCallParse("", tuple(calls))
