"""A byte-level recognizer of one JSON object, for JSON mode (``response_format`` json_object).
Pure Python.

``JsonState`` is immutable and hashable, so the set of tokens allowed in a state can be cached::

    state = START                         # expects "{" (after optional whitespace)
    state = advance(state, b'{"a": [1')   # None as soon as the bytes cannot begin a JSON object
    state.complete                        # True once the top-level object has been closed

What it accepts is RFC 8259 JSON whose top-level value is an object, with two limits that keep a
sampling model from running away: at most ``MAX_WHITESPACE`` whitespace bytes in a row between
tokens, and nothing after the closing brace. Inside strings every byte from 0x20 up is accepted
except an unescaped ``"`` or ``\\`` (bytes of 0x80 and up are not checked to be valid UTF-8).
A number may end only where the next byte is a delimiter, so the state after ``1`` still allows
``2``, ``.``, ``e`` and the delimiters.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_WHITESPACE = 4
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# modes
_VALUE = 0           # a value must come (after ":" or "," in an array)
_OBJ_FIRST = 1       # after "{": a key or "}"
_OBJ_KEY = 2         # after "," in an object: a key
_COLON = 3           # after a key
_AFTER = 4           # after a value inside a container: "," or the closer
_ARR_FIRST = 5       # after "[": a value or "]"
_STRING = 6          # inside a string (aux: 1 = a key)
_ESCAPE = 7          # after a backslash in a string (aux: key flag)
_UNICODE = 8         # inside \uXXXX (aux: key flag * 8 + hex digits left)
_NUMBER = 9          # inside a number (aux: its sub-state, see _number_next)
_LITERAL = 10        # inside true/false/null (aux: the bytes still to come)
_START = 11          # before the top-level "{"
_DONE = 12           # after the top-level "}"

# number sub-states: 0 after "-", 1 after a leading 0, 2 in integer digits, 3 after ".",
# 4 in fraction digits, 5 after "e", 6 after the exponent's sign, 7 in exponent digits
_NUMBER_ENDS = frozenset({1, 2, 4, 7})


@dataclass(frozen=True, slots=True)
class JsonState:
    stack: tuple[int, ...]  # open containers, innermost last: ord("{") or ord("[")
    mode: int
    aux: object = None
    whitespace: int = 0

    @property
    def complete(self) -> bool:
        return self.mode == _DONE


START = JsonState((), _START)


def advance(state: JsonState | None, data: bytes) -> JsonState | None:
    """The state after ``data``; None when ``data`` cannot continue a JSON object from ``state``."""
    for byte in data:
        if state is None:
            return None
        state = step(state, byte)
    return state


def step(s: JsonState, b: int) -> JsonState | None:
    """The state after one byte ``b``, or None."""
    mode = s.mode
    if mode == _STRING:
        if b == 0x22:  # closing quote
            return JsonState(s.stack, _COLON if s.aux else _after_value(s.stack))
        if b == 0x5C:
            return JsonState(s.stack, _ESCAPE, s.aux)
        return s if b >= 0x20 else None
    if mode == _ESCAPE:
        if b not in _ESCAPES:
            return None
        if b == ord("u"):
            return JsonState(s.stack, _UNICODE, (1 if s.aux else 0) * 8 + 4)
        return JsonState(s.stack, _STRING, s.aux)
    if mode == _UNICODE:
        if b not in _HEX:
            return None
        key, left = divmod(s.aux, 8)
        if left == 1:
            return JsonState(s.stack, _STRING, key)
        return JsonState(s.stack, _UNICODE, key * 8 + left - 1)
    if mode == _NUMBER:
        nxt = _number_next(s.aux, b)
        if nxt is not None:
            return JsonState(s.stack, _NUMBER, nxt)
        if s.aux not in _NUMBER_ENDS:
            return None
        return step(JsonState(s.stack, _after_value(s.stack)), b)  # the byte after the number
    if mode == _LITERAL:
        rest = s.aux
        if b != rest[0]:
            return None
        if len(rest) == 1:
            return JsonState(s.stack, _after_value(s.stack))
        return JsonState(s.stack, _LITERAL, rest[1:])
    if b in _WS:
        if mode == _DONE or s.whitespace >= MAX_WHITESPACE:
            return None
        return JsonState(s.stack, mode, s.aux, s.whitespace + 1)
    if mode == _START:
        return JsonState((0x7B,), _OBJ_FIRST) if b == 0x7B else None
    if mode in (_OBJ_FIRST, _OBJ_KEY):
        if b == 0x22:
            return JsonState(s.stack, _STRING, 1)
        if b == 0x7D and mode == _OBJ_FIRST:
            return _close(s.stack)
        return None
    if mode == _COLON:
        return JsonState(s.stack, _VALUE) if b == 0x3A else None
    if mode == _AFTER:
        top = s.stack[-1]
        if b == 0x2C:
            return JsonState(s.stack, _OBJ_KEY if top == 0x7B else _VALUE)
        if (b == 0x7D and top == 0x7B) or (b == 0x5D and top == 0x5B):
            return _close(s.stack)
        return None
    if mode in (_VALUE, _ARR_FIRST):
        if b == 0x5D and mode == _ARR_FIRST:
            return _close(s.stack)
        return _value_start(s.stack, b)
    return None  # _DONE: nothing may follow


def _after_value(stack: tuple[int, ...]) -> int:
    """The mode after a complete value: inside a container, or done at the top level."""
    return _AFTER if stack else _DONE


def _close(stack: tuple[int, ...]) -> JsonState:
    rest = stack[:-1]
    return JsonState(rest, _after_value(rest))


def _value_start(stack: tuple[int, ...], b: int) -> JsonState | None:
    if b == 0x7B:
        return JsonState(stack + (0x7B,), _OBJ_FIRST)
    if b == 0x5B:
        return JsonState(stack + (0x5B,), _ARR_FIRST)
    if b == 0x22:
        return JsonState(stack, _STRING, 0)
    if b == 0x2D:
        return JsonState(stack, _NUMBER, 0)
    if b == 0x30:
        return JsonState(stack, _NUMBER, 1)
    if b in _DIGITS:
        return JsonState(stack, _NUMBER, 2)
    if b in _LITERALS:
        return JsonState(stack, _LITERAL, _LITERALS[b])
    return None


def _number_next(sub: int, b: int) -> int | None:
    digit = b in _DIGITS
    if sub == 0:  # after "-"
        return 1 if b == 0x30 else 2 if digit else None
    if sub in (1, 2):  # integer part
        if digit and sub == 2:
            return 2
        if b == 0x2E:
            return 3
        if b in (0x65, 0x45):
            return 5
        return None
    if sub in (3, 4):  # fraction
        if digit:
            return 4
        return 5 if sub == 4 and b in (0x65, 0x45) else None
    if sub == 5:  # after "e"
        return 6 if b in (0x2B, 0x2D) else 7 if digit else None
    return 7 if digit else None  # after the exponent sign, or in its digits
