"""Tool calls of one choice as OpenAI's stream deltas, and their ids.

With a parser that has a cursor (``ToolParser.cursor``: the built-in ones), each chunk the
cursor scans only the text that is new, and the stream slices what is new since the last chunk
out of the text by position: the whole stream costs time linear in its output. Otherwise each
chunk the parser reads the whole output so far (``ToolParser.parse`` with ``final`` on
the last). Either way the stream sends what is new since the last chunk: content, then for each call
one delta with its index, id, type and name (and the arguments so far) once its name is
known, then fragments of its arguments. The fragments of a call concatenate to the arguments of
the parse of the whole output. Should a later parse not extend what was sent (the output turned
out malformed after a call was sent), the stream sends nothing more for that choice but its
finish.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from tandem.interfaces import ToolCallParse, ToolParser
from tandem.server.protocol import DeltaFunctionCall, DeltaToolCall

logger = logging.getLogger("tandem.server")


def new_tool_call_id() -> str:
    """A unique tool call id, in vLLM's form ``chatcmpl-tool-<32 hex digits>``."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCallStream:
    """What one choice's stream has sent: its content, and per call its id, name, arguments."""

    parser: ToolParser
    max_calls: int | None = None
    """Calls past this many are not sent (``parallel_tool_calls: false``)."""
    content: str = ""
    ids: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)
    stopped: bool = False
    cursor: Any = None
    """The parser's cursor (None: each chunk re-parses the whole output)."""
    content_sent: int = 0
    args_sent: list[int] = field(default_factory=list)
    """With a cursor: where the content and each call's arguments sent so far end in the text."""

    def __post_init__(self) -> None:
        self.cursor = self.parser.cursor()

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def update(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and the tool-call deltas that ``text`` (the output so far) adds."""
        if self.stopped:
            return "", []
        if self.cursor is not None:
            return self._update_by_cursor(text, final)
        parse = self.parser.parse(text, final)
        if not self._extends(parse):
            return self._stop()
        content, self.content = parse.content[len(self.content):], parse.content
        deltas = []
        for index, call in enumerate(parse.calls[:self.max_calls]):
            if call.name is None:
                break
            if index == len(self.ids):
                self.ids.append(new_tool_call_id())
                self.names.append(call.name)
                self.arguments.append(call.arguments)
                deltas.append(DeltaToolCall(index=index, id=self.ids[index], type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments=call.arguments)))
            elif len(call.arguments) > len(self.arguments[index]):
                fragment = call.arguments[len(self.arguments[index]):]
                self.arguments[index] = call.arguments
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        return content, deltas

    def _update_by_cursor(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        cursor = self.cursor
        cursor.feed(text, final)
        if cursor.malformed and self.ids:
            return self._stop()
        content = ""
        if cursor.content_end > self.content_sent:
            content = text[self.content_sent:cursor.content_end]
            self.content_sent = cursor.content_end
        deltas = []
        last = len(cursor.calls) if self.max_calls is None else min(len(cursor.calls), self.max_calls)
        for index in range(max(len(self.ids) - 1, 0), 0 if cursor.malformed else last):
            call = cursor.calls[index]
            if call.name is None:
                break
            end = call.args_end(text)
            if index == len(self.ids):
                self.ids.append(new_tool_call_id())
                self.names.append(call.name)
                self.args_sent.append(end)
                deltas.append(DeltaToolCall(index=index, id=self.ids[index], type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments=text[call.args_start:end])))
            elif end > max(self.args_sent[index], call.args_start):  # the arguments may start late
                fragment = text[max(self.args_sent[index], call.args_start):end]
                self.args_sent[index] = end
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        return content, deltas

    def _stop(self) -> tuple[str, list[DeltaToolCall]]:
        self.stopped = True
        logger.warning("a streamed tool call turned out malformed after it was sent; the rest "
                       "of the output is not streamed")
        return "", []

    def _extends(self, parse: ToolCallParse) -> bool:
        if not parse.content.startswith(self.content) or len(parse.calls) < len(self.ids):
            return False
        return all(call.name == name and call.arguments.startswith(arguments)
                   for call, name, arguments in zip(parse.calls, self.names, self.arguments))
