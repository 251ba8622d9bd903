"""Scanning JSON that may be cut short: the tool parsers read a model's output while it streams,
so a value can end anywhere. Each scanner starts at an index of the text and answers where the
value ends, or None when the text ends first (it may still be completed); ``Malformed`` when no
continuation could make it valid JSON.

A call object is ``{"<name key>": "<function>", "<arguments key>": <value>, ...}`` in any key
order; ``scan_call`` reports its name once the name's string is closed, and the raw text of its
arguments as far as it goes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tandem.interfaces import ParsedToolCall

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NESTING = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[-+.0-9eE]+|true|false|null|[a-z]+")
_CLOSER = {"{": "}", "[": "]"}


class Malformed(Exception):
    """The text cannot be the JSON the scanner expects, however it continues."""


def skip_ws(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def scan_string(text: str, pos: int) -> int | None:
    """The end of the JSON string starting at ``text[pos]`` (a ``"``), or None."""
    match = _STRING.match(text, pos)
    return match.end() if match else None


def scan_value(text: str, pos: int) -> int | None:
    """The end of the JSON value starting at ``text[pos]`` (no whitespace before it), or None.
    A complete value is checked with ``json.loads``; an incomplete one only for its brackets."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        end = scan_string(text, pos)
    elif first in _CLOSER:
        end = _scan_nested(text, pos)
    else:
        match = _SCALAR.match(text, pos)
        if match is None:
            raise Malformed(f"no JSON value starts with {first!r}")
        end = match.end() if match.end() < len(text) else None  # a number may go on
    if end is not None:
        _check(text[pos:end])
    return end


def _scan_nested(text: str, pos: int) -> int | None:
    stack: list[str] = []
    i = pos
    while True:
        match = _NESTING.search(text, i)
        if match is None:
            return None
        char = match.group()
        if char == '"':
            end = scan_string(text, match.start())
            if end is None:
                return None
            i = end
            continue
        if char in _CLOSER:
            stack.append(_CLOSER[char])
        elif not stack or stack.pop() != char:
            raise Malformed(f"unbalanced {char!r}")
        i = match.end()
        if not stack:
            return i


def _check(value_text: str) -> None:
    try:
        json.loads(value_text)
    except ValueError as exc:
        raise Malformed(str(exc)) from None


@dataclass(slots=True, frozen=True)
class CallKeys:
    """The keys of a call object: its function's name, and its arguments (the first present of
    ``arguments``)."""

    name: str
    arguments: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class CallScan:
    call: ParsedToolCall
    end: int | None
    """Where the call object ends; None when the text ends inside it."""


def scan_call(text: str, pos: int, keys: CallKeys) -> CallScan:
    """The call object at ``text[pos]`` (whitespace first allowed). A complete object needs a
    string name and arguments, or it is ``Malformed``."""
    pos = skip_ws(text, pos)
    if pos >= len(text):
        return CallScan(ParsedToolCall(None, ""), None)
    if text[pos] != "{":
        raise Malformed("a tool call must be a JSON object")
    name, arguments = None, None
    pos = skip_ws(text, pos + 1)
    if text.startswith("}", pos):
        raise Malformed("the tool call object is empty")
    while True:
        if pos >= len(text):
            break
        if text[pos] != '"':
            raise Malformed("a key must be a string")
        key_end = scan_string(text, pos)
        if key_end is None:
            break
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text):
            break
        if text[pos] != ":":
            raise Malformed("expected ':' after a key")
        start = skip_ws(text, pos + 1)
        end = scan_value(text, start)
        if key == keys.name and end is not None:
            name = json.loads(text[start:end])
            if not isinstance(name, str):
                raise Malformed("the function name must be a string")
        elif key in keys.arguments and arguments is None:
            arguments = text[start:len(text) if end is None else end]
        if end is None:
            break
        pos = skip_ws(text, end)
        if pos >= len(text):
            break
        if text[pos] == "}":
            if name is None or arguments is None:
                raise Malformed(f"a tool call needs {keys.name!r} and {keys.arguments[0]!r}")
            return CallScan(ParsedToolCall(name, arguments), pos + 1)
        if text[pos] != ",":
            raise Malformed("expected ',' or '}' after a value")
        pos = skip_ws(text, pos + 1)
    return CallScan(ParsedToolCall(name, arguments or ""), None)


def scan_call_list(text: str, pos: int, keys: CallKeys, separator: str,
                   closer: str | None) -> tuple[list[ParsedToolCall], bool]:
    """Call objects from ``text[pos]`` on, separated by ``separator`` and ended by ``closer`` (by
    the end of the text when None; a trailing separator is allowed then). Returns the calls and
    whether the list is complete: its closer seen, or (without one) its last object closed."""
    calls: list[ParsedToolCall] = []
    while True:
        scan = scan_call(text, pos, keys)
        if scan.end is None:
            started = skip_ws(text, pos) < len(text)
            if started:
                calls.append(scan.call)
            return calls, closer is None and bool(calls) and not started
        calls.append(scan.call)
        pos = skip_ws(text, scan.end)
        if pos >= len(text):
            return calls, closer is None
        if text.startswith(separator, pos):
            pos += len(separator)
        elif closer is not None and text.startswith(closer, pos):
            if skip_ws(text, pos + len(closer)) < len(text):
                raise Malformed(f"text after the closing {closer!r}")
            return calls, True
        else:
            raise Malformed(f"expected {separator!r} between tool calls")
