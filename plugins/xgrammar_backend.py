"""The built-in structured-output backend, on xgrammar (entry point ``builtin_structured_outputs``).

Every kind of ``StructuredOutputsParams`` becomes an xgrammar ``Grammar`` (parsing: cheap, done
by ``validate``), then a ``CompiledGrammar`` (the token masks of the grammar's states: the slow
part, done by ``compile`` on tandem's compile thread)::

    json            Grammar.from_json_schema (strict mode: an object without
                    "additionalProperties" takes none beyond its "properties")
    json_object     the schema {"type": "object"}
    regex           Grammar.from_regex
    choice          an EBNF alternation of the choices as JSON string literals
    grammar         Grammar.from_ebnf (GBNF dialect, root rule "root")
    structural_tag  Grammar.from_structural_tag

``disable_any_whitespace`` makes JSON compact (``","`` and ``":"`` with no spaces around them);
otherwise JSON may have up to ``JSON_MAX_WHITESPACE`` whitespace characters between its tokens.
"""
from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

import tandem
from tandem.hookspecs import Register
from tandem.interfaces import StructuredOutputBackend, StructuredOutputGrammar

JSON_MAX_WHITESPACE = 32
"""Most whitespace characters between two JSON tokens (xgrammar's ``max_whitespace_cnt``): a
greedy model could otherwise emit whitespace forever, which JSON allows."""

_JSON_STRING_CHARS = r'[^\0-\x1f\"\\\uD800-\uDFFF]'
_LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
"""xgrammar 0.2.9 writes the unescaped characters of a JSON string as these classes: the
first (strings with a length bound) lets control characters through, and both let UTF-8
encoded surrogates (U+D800-U+DFFF) through. Neither is JSON text (strict parsers such as
Python's json refuse control characters; surrogates decode to U+FFFD, which breaks
maxLength), so tandem puts ``_JSON_STRING_CHARS`` in their place, re-reading the grammar's
EBNF. (Escapes stay out of length-bounded strings, as in xgrammar.)"""

_LOCATION = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: ")
"""xgrammar's C++ errors start with the time and the source file: not for users."""


class XGrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, token_ids: list[int]) -> bool:
        return all(self.matcher.accept_token(t) for t in token_ids)

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fork(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.matcher.fork())


class XGrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._batch = xgr.BatchGrammarMatcher(max_threads=2)

    def validate(self, params: Any) -> None:
        _grammar_of(params)

    def compile(self, params: Any) -> xgr.CompiledGrammar:
        grammar = _grammar_of(params)
        try:
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(_message(exc)) from None

    def grammar(self, compiled: xgr.CompiledGrammar) -> XGrammarGrammar:
        return XGrammarGrammar(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: Any) -> None:
        self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask)


def _grammar_of(params: Any) -> xgr.Grammar:
    """The grammar ``params`` asks for; ValueError naming the problem when xgrammar refuses it."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json if kind == "json" else {"type": "object"}
            text = schema if isinstance(schema, str) else json.dumps(schema)
            compact = (",", ":") if params.disable_any_whitespace else None
            grammar = xgr.Grammar.from_json_schema(
                text, any_whitespace=not params.disable_any_whitespace, separators=compact,
                strict_mode=True, max_whitespace_cnt=None if compact else JSON_MAX_WHITESPACE)
            return _strict_json_strings(grammar)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_structural_tag(params.structural_tag)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"{_KIND_NAMES[kind]} was refused by xgrammar: {_message(exc)}") from None


def _strict_json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    ebnf = str(grammar)
    fixed = ebnf
    for loose in _LOOSE_STRING_CHARS:
        fixed = fixed.replace(loose, _JSON_STRING_CHARS)
    return grammar if fixed == ebnf else xgr.Grammar.from_ebnf(fixed)


_KIND_NAMES = {
    "json": "the JSON schema", "json_object": "JSON mode", "regex": "the regular expression",
    "choice": "the choices", "grammar": "the EBNF grammar", "structural_tag": "the structural tag",
}


def _message(exc: BaseException) -> str:
    return _LOCATION.sub("", str(exc).strip()).strip()


@tandem.hookimpl
def tandem_register_structured_output_backends(register: Register) -> None:
    register("xgrammar", XGrammarBackend)
