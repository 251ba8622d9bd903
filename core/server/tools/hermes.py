"""The ``hermes`` tool parser: calls in ``<tool_call>`` tags, as Hermes 2 Pro, Qwen 2.5 and
Qwen 3 write them::

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The content is the text before the first tag; text between or after the calls is dropped (as
vLLM's parser does). A last call may lack its closing tag when the output ends. While streaming,
a tail of the text that could be the start of ``<tool_call>`` is held back from the content.
"""
from __future__ import annotations

from tandem.interfaces import ParsedToolCall, ToolCallParse, ToolParser
from tandem.server.tools.incremental import CallScanner, ToolCallCursor
from tandem.server.tools.json_scan import CallKeys, Malformed, scan_call, skip_ws

START = "<tool_call>"
END = "</tool_call>"
_KEYS = CallKeys("name", ("arguments",))


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ToolCallParse:
        first = text.find(START)
        if first < 0:
            return ToolCallParse(text if final else text[:len(text) - partial_tag_len(text, START)])
        try:
            calls = _calls(text, first, final)
        except Malformed:
            return ToolCallParse(text)
        return ToolCallParse(text[:first], tuple(calls))

    def cursor(self) -> HermesCursor:
        return HermesCursor()


class HermesCursor(ToolCallCursor):
    """``HermesToolParser.parse`` one character at a time (see tandem.server.tools.incremental)."""

    def __init__(self) -> None:
        super().__init__()
        self._searched = 0  # where the search for the next START tag goes on from
        self._between = False  # the last call is closed by its END tag: the next START is searched

    def _find_start(self, text: str, since: int) -> int:
        found = text.find(START, max(since, self._searched - len(START) + 1))
        self._searched = len(text) if found < 0 else found + len(START)
        return found

    def _scan(self, text: str, final: bool) -> None:
        if not self.calls:
            found = self._find_start(text, 0)
            if found < 0:
                self.content_end = len(text) if final else len(text) - partial_tag_len(text, START)
                return
            self.content_end = found
            self.calls.append(CallScanner(found + len(START), _KEYS))
        while True:
            call = self.calls[-1]
            if not self._between:
                if not call.advance(text):
                    if final:
                        raise Malformed("the output ends inside a tool call")
                    return
                after = skip_ws(text, call.end)
                if text.startswith(END, after):
                    self._between = True
                    self._searched = after + len(END)
                elif len(text) - after < len(END) and END.startswith(text[after:]):
                    return  # the end of the text, or a closing tag cut short
                else:
                    raise Malformed(f"expected {END} after a tool call")
            found = self._find_start(text, 0)
            if found < 0:
                return
            self.calls.append(CallScanner(found + len(START), _KEYS))
            self._between = False


def _calls(text: str, start: int, final: bool) -> list[ParsedToolCall]:
    calls = []
    while start >= 0:
        scan = scan_call(text, start + len(START), _KEYS)
        calls.append(scan.call)
        if scan.end is None:
            if final:
                raise Malformed("the output ends inside a tool call")
            break
        after = skip_ws(text, scan.end)
        if text.startswith(END, after):
            start = text.find(START, after + len(END))
        elif END.startswith(text[after:]):  # the end of the text, or a closing tag cut short
            break
        else:
            raise Malformed(f"expected {END} after a tool call")
    return calls


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
