"""Tool calls of one choice as OpenAI's stream deltas, and their ids.

Each chunk the parser reads the whole output so far (``ToolParser.parse`` with ``final`` on
the last) and the stream sends what is new since the last chunk: content, then for each call
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

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def update(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """The content and the tool-call deltas that ``text`` (the output so far) adds."""
        if self.stopped:
            return "", []
        parse = self.parser.parse(text, final)
        if not self._extends(parse):
            self.stopped = True
            logger.warning("a streamed tool call turned out malformed after it was sent; the rest "
                           "of the output is not streamed")
            return "", []
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

    def _extends(self, parse: ToolCallParse) -> bool:
        if not parse.content.startswith(self.content) or len(parse.calls) < len(self.ids):
            return False
        return all(call.name == name and call.arguments.startswith(arguments)
                   for call, name, arguments in zip(parse.calls, self.names, self.arguments))
