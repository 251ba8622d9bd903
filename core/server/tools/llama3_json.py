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

import re

from tandem.interfaces import ToolCallParse, ToolParser
from tandem.server.tools.incremental import CallListCursor
from tandem.server.tools.json_scan import CallKeys, Malformed, scan_call_list

PYTHON_TAG = "<|python_tag|>"
_KEYS = CallKeys("name", ("parameters", "arguments"))
_LEADING_SPACE = re.compile(r"\s*")


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

    def cursor(self) -> Llama3JsonCursor:
        return Llama3JsonCursor()


class Llama3JsonCursor(CallListCursor):
    """``Llama3JsonToolParser.parse`` one character at a time (see
    tandem.server.tools.incremental)."""

    def __init__(self) -> None:
        super().__init__(_KEYS, ";", None)
        self._mode: str | None = None  # None: undecided; "calls" or "content"
        self._body = 0

    def _scan(self, text: str, final: bool) -> None:
        if self._mode is None:
            self._body = body = _LEADING_SPACE.match(text, self._body).end()
            if text.startswith(PYTHON_TAG, body):
                self._mode = "calls"
                self.start_calls(body + len(PYTHON_TAG))
            elif text.startswith("{", body):
                self._mode = "calls"
                self.start_calls(body)
            elif not final and len(text) - body < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[body:]):
                return
            else:
                self._mode = "content"
        if self._mode == "content":
            self.content_end = len(text)
            return
        self._scan_list(text, final)
