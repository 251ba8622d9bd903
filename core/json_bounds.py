"""JSON from a peer, parsed only once its nesting is known to be shallow: ``json.loads`` recurses
once per nested array or object, so a body of ``[[[[…`` would otherwise end in RecursionError.

The depth is measured before parsing, in vectorised passes over the bytes: a quote preceded by
an even number of backslashes opens or closes a string, and only the brackets outside strings
count. For valid JSON this is the parser's own nesting; for invalid JSON the parser stops at the
first error, and up to there it reads strings as this does.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``data`` (0 for a scalar)."""
    codes = np.frombuffer(data, dtype=np.uint8)
    if codes.size == 0:
        return 0
    index = np.arange(codes.size)
    last_plain = np.maximum.accumulate(np.where(codes != _BACKSLASH, index, -1))
    backslashes_before = np.zeros(codes.size, dtype=np.int64)
    backslashes_before[1:] = index[:-1] - last_plain[:-1]
    quotes = (codes == _QUOTE) & (backslashes_before % 2 == 0)
    outside = np.cumsum(quotes) % 2 == 0
    steps = np.isin(codes, _OPEN).astype(np.int64) - np.isin(codes, _CLOSE)
    return int(max(np.cumsum(np.where(outside, steps, 0)).max(), 0))


def loads_bounded(data: bytes, max_depth: int) -> Any:
    """``json.loads(data)``; ValueError when it is not JSON or nests deeper than ``max_depth``."""
    depth = json_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep, more than {max_depth}")
    return json.loads(data)
