"""``json_depth`` against the nesting of what Python's own ``json`` parses, over JSON texts whose
strings hold brackets, quotes and backslashes (escaped as ``json.dumps`` escapes them)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.json_bounds import json_depth, loads_bounded

_TRICKY = st.text(alphabet='[]{}"\\ ,:ab\n', max_size=12)
_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | _TRICKY,
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TRICKY, inner, max_size=4),
                       max_leaves=30)


def nesting(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(nesting, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(nesting, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(_VALUES, st.booleans())
def test_the_depth_is_the_parsed_nesting(value, indent):
    text = json.dumps(value, indent=1 if indent else None, ensure_ascii=False).encode()
    assert json_depth(text) == nesting(value)


@pytest.mark.parametrize("text, depth", [(b"[" * 100_000, 100_000), (b'"' + b"[" * 50, 0), (b"", 0)])
def test_broken_texts_are_measured_without_parsing(text, depth):
    assert json_depth(text) == depth


def test_loads_bounded_refuses_what_json_loads_would_recurse_into():
    with pytest.raises(RecursionError):
        json.loads(b"[" * 100_000)
    with pytest.raises(ValueError, match="nested 100000 deep, more than 8"):
        loads_bounded(b"[" * 100_000, 8)
    assert loads_bounded(b'{"a": [[1]]}', 3) == {"a": [[1]]}
