"""Streamed tool-call parsing that reads each character of the output once.

A ``ToolCallCursor`` is one choice's parse in progress. ``feed(text, final)`` takes the whole
output so far (it only grows) and scans only what is past its position, so a stream costs time
linear in its output, not in its output times its chunks. After each feed it answers, as
positions in ``text``, what the parse of the whole text would say (``ToolParser.parse``)::

    content_end         the content is text[:content_end] (it only grows)
    calls[i].name       None until the name's string is closed
    calls[i].arguments  text[args_start:args_end]: the raw text of the arguments so far
    malformed           no continuation can make the calls valid JSON: all of it is content

``CallScanner`` reads one call object ``{"<name>": ..., "<arguments>": ..., ...}`` and
``ValueScanner`` one JSON value, each resuming where the last feed stopped; a complete value is
checked once with ``json.loads``.
"""
from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod

from tandem.server.tools.json_scan import CallKeys, Malformed, skip_ws

_SCALAR = re.compile(r"[-+.0-9eE]+|true|false|null|[a-z]+")
_NESTING = re.compile(r'["{}\[\]]')
_STRING_STOP = re.compile(r'["\\]')
_CLOSER = {"{": "}", "[": "]"}


def _check(value_text: str) -> None:
    try:
        json.loads(value_text)
    except ValueError as exc:
        raise Malformed(str(exc)) from None


class ValueScanner:
    """One JSON value starting at ``start`` (no whitespace before it)."""

    __slots__ = ("start", "pos", "kind", "stack", "in_string", "end")

    def __init__(self, start: int) -> None:
        self.start = self.pos = start
        self.kind: str | None = None
        self.stack: list[str] = []
        self.in_string = False
        self.end: int | None = None

    def advance(self, text: str) -> bool:
        """Scan on; True once the value is complete (``end`` set). Raises ``Malformed``."""
        if self.end is not None:
            return True
        if self.kind is None:
            if self.pos >= len(text):
                return False
            first = text[self.pos]
            self.kind = "scalar" if first not in '"{[' else "nested"
        if self.kind == "scalar":  # short: matched again from its start
            match = _SCALAR.match(text, self.start)
            if match is None:
                raise Malformed(f"no JSON value starts with {text[self.start]!r}")
            if match.end() >= len(text):
                return False  # a number may go on
            return self._done(text, match.end())
        return self._advance_nested(text)

    def _advance_nested(self, text: str) -> bool:
        while True:
            if self.in_string:
                match = _STRING_STOP.search(text, self.pos)
                if match is None:
                    self.pos = len(text)
                    return False
                if match.group() == "\\":
                    if match.start() + 1 >= len(text):
                        self.pos = match.start()
                        return False
                    self.pos = match.start() + 2
                    continue
                self.pos = match.end()
                self.in_string = False
                if not self.stack:
                    return self._done(text, self.pos)
                continue
            match = _NESTING.search(text, self.pos)
            if match is None:
                self.pos = len(text)
                return False
            char = match.group()
            self.pos = match.end()
            if char == '"':
                self.in_string = True
                continue
            if char in _CLOSER:
                self.stack.append(_CLOSER[char])
            elif not self.stack or self.stack.pop() != char:
                raise Malformed(f"unbalanced {char!r}")
            if not self.stack:
                return self._done(text, self.pos)

    def _done(self, text: str, end: int) -> bool:
        _check(text[self.start:end])
        self.end = end
        return True


class CallScanner:
    """One call object from ``pos`` on (whitespace first allowed); ``end`` once it closed."""

    __slots__ = ("keys", "pos", "state", "key", "value", "name", "args_start", "args_value", "end")

    def __init__(self, pos: int, keys: CallKeys) -> None:
        self.keys = keys
        self.pos = pos
        self.state = "open"
        self.key: str | None = None
        self.value: ValueScanner | None = None
        self.name: str | None = None
        self.args_start = 0
        self.args_value: ValueScanner | None = None
        self.end: int | None = None

    @property
    def started(self) -> bool:
        return self.state != "open"

    def args_end(self, text: str) -> int:
        """Where the arguments' text ends so far (the end of the text while they go on)."""
        value = self.args_value
        if value is None or value.kind is None:
            return self.args_start
        return value.end if value.end is not None else len(text)

    def advance(self, text: str) -> bool:
        """Scan on; True once the object is closed. Raises ``Malformed``."""
        while self.end is None:
            if self.state == "value":
                if not self._advance_value(text):
                    return False
                continue
            self.pos = skip_ws(text, self.pos)
            if self.pos >= len(text):
                return False
            self._step(text, text[self.pos])
        return True

    def _step(self, text: str, char: str) -> None:
        state = self.state
        if state == "open":
            if char != "{":
                raise Malformed("a tool call must be a JSON object")
            self.pos += 1
            self.state = "first"
        elif state in ("first", "key"):
            if char == "}" and state == "first":
                raise Malformed("the tool call object is empty")
            if char != '"':
                raise Malformed("a key must be a string")
            self.value = ValueScanner(self.pos)
            self.state = "key_string"
        elif state == "key_string":
            if not self.value.advance(text):
                self.pos = len(text)
                return
            self.key = json.loads(text[self.value.start:self.value.end])
            self.pos = self.value.end
            self.state = "colon"
        elif state == "colon":
            if char != ":":
                raise Malformed("expected ':' after a key")
            self.pos = skip_ws(text, self.pos + 1)
            self.value = ValueScanner(self.pos)
            if self.key in self.keys.arguments and self.args_value is None:
                self.args_start, self.args_value = self.pos, self.value
            self.state = "value"
        else:  # after a value
            if char == "}":
                if self.name is None or self.args_value is None:
                    raise Malformed(f"a tool call needs {self.keys.name!r} and {self.keys.arguments[0]!r}")
                self.end = self.pos + 1
            elif char == ",":
                self.pos += 1
                self.state = "key"
            else:
                raise Malformed("expected ',' or '}' after a value")

    def _advance_value(self, text: str) -> bool:
        value = self.value
        if value.kind is None:  # not begun: whitespace may have come since
            value.start = value.pos = skip_ws(text, value.start)
            if self.args_value is value:
                self.args_start = value.start
            if value.start >= len(text):
                return False
        if not value.advance(text):
            return False
        if self.key == self.keys.name:
            name = json.loads(text[value.start:value.end])
            if not isinstance(name, str):
                raise Malformed("the function name must be a string")
            self.name = name
        self.pos = value.end
        self.state = "after"
        return True


class ToolCallCursor(ABC):
    """One choice's parse in progress (see the module docstring); a parser's own subclass
    says where the calls start and what comes between them."""

    def __init__(self) -> None:
        self.content_end = 0
        self.calls: list[CallScanner] = []
        self.malformed = False

    def feed(self, text: str, final: bool) -> None:
        if self.malformed:
            self.content_end = len(text)
            return
        try:
            self._scan(text, final)
        except Malformed:
            self.malformed = True
            self.content_end = len(text)

    @abstractmethod
    def _scan(self, text: str, final: bool) -> None:
        """Advance over ``text``; raise ``Malformed`` as ``ToolParser.parse`` would return all
        content (``final``: the output is complete)."""


class CallListCursor(ToolCallCursor):
    """Calls from ``start`` on, separated by ``separator`` and ended by ``closer`` (by the end
    of the text when None; a trailing separator is allowed then), as ``scan_call_list``."""

    def __init__(self, keys: CallKeys, separator: str, closer: str | None) -> None:
        super().__init__()
        self.keys, self.separator, self.closer = keys, separator, closer
        self.complete = False
        self.closed = False
        self._after_close = 0

    def start_calls(self, pos: int) -> None:
        self.calls.append(CallScanner(pos, self.keys))

    def _scan_list(self, text: str, final: bool) -> None:
        """Advance the list once ``start_calls`` was called."""
        while not self.closed:
            call = self.calls[-1]
            if not call.advance(text):
                self.complete = self.closer is None and not call.started and len(self.calls) > 1
                break
            pos = skip_ws(text, call.end)
            if pos >= len(text):
                self.complete = self.closer is None
                break
            if text.startswith(self.separator, pos):
                self.calls.append(CallScanner(pos + len(self.separator), self.keys))
            elif self.closer is not None and text.startswith(self.closer, pos):
                self.closed = self.complete = True
                self._after_close = pos + len(self.closer)
            else:
                raise Malformed(f"expected {self.separator!r} between tool calls")
        if self.closed and skip_ws(text, self._after_close) < len(text):
            raise Malformed(f"text after the closing {self.closer!r}")
        if final and not self.complete:
            raise Malformed("the output ends inside the tool calls")


class WholeTextCall:
    """A call whose arguments are the whole output (a named function's forced call)."""

    __slots__ = ("name", "args_start", "end")

    def __init__(self, name: str) -> None:
        self.name = name
        self.args_start = 0
        self.end = None

    def args_end(self, text: str) -> int:
        return len(text)
