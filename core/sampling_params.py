"""Sampling parameters of one request, shaped like vLLM's so that users' scripts carry over.

Pure Python: the scheduler side imports this, so it must never import torch.
"""
from __future__ import annotations

import math
import json
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidRequest, check_text

SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
"""Seeds are signed 64-bit integers, as in vLLM (torch.long)."""
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
"""Generous bounds on what every step checks for each sequence (OpenAI allows 4 stop strings)."""
LOGIT_BIAS_MAX = 100.0
"""A logit bias lies in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX], as in OpenAI's API."""
MAX_TOKEN_ID_ENTRIES = 65536
"""At most this many ``logit_bias`` entries, and as many ``allowed_token_ids``."""
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1024
MAX_GRAMMAR_CHARS = 65_536
"""Longest structured-output grammar (its canonical text: a schema's JSON, a regex, the choices
as a JSON list): compiles run one at a time, so one huge grammar would delay all others."""


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What the output must match, as vLLM's ``StructuredOutputsParams``: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value valid
      against it;
    - ``json_object``: True: the output is one JSON object (OpenAI's JSON mode);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: a non-empty list of strings; the output is one of them;
    - ``grammar``: an EBNF grammar (GBNF/xgrammar dialect, with a ``root`` rule);
    - ``structural_tag``: an xgrammar structural tag (its JSON text).

    ``disable_any_whitespace`` makes JSON outputs compact.
    Pure data: the structured-output backend (``tandem.interfaces.StructuredOutputBackend``)
    compiles it, and refuses what it cannot (a 400 naming the problem). ``key`` identifies the
    grammar for the compile cache.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        where = "structured_outputs"
        if len(given) != 1:
            raise InvalidRequest(where, "must set exactly one of " + ", ".join(self.KINDS)
                                 + (f" (got {', '.join(given)})" if given else " (got none)"), "SamplingParams")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise InvalidRequest(f"{where}.json", "must be a JSON schema: an object or its JSON text", "SamplingParams")
        if kind == "json" and isinstance(value, str):
            try:
                json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"{where}.json", f"is not valid JSON ({exc})", "SamplingParams") from None
        if kind in ("regex", "grammar", "structural_tag") and not (isinstance(value, str) and value):
            raise InvalidRequest(f"{where}.{kind}", "must be a non-empty string", "SamplingParams")
        if kind == "choice" and not (value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{where}.choice", "must be a non-empty list of non-empty strings",
                                 "SamplingParams")
        if kind == "json_object" and value is not True:
            raise InvalidRequest(f"{where}.json_object", "must be true", "SamplingParams")
        size = len(self.key[1])
        if size > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"{where}.{kind}", f"must be at most {MAX_GRAMMAR_CHARS} characters "
                                 f"long (got {size})", "SamplingParams")

    @property
    def kind(self) -> str:
        """Which of ``KINDS`` is set."""
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text of the grammar, options): equal keys compile to one grammar."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json":
            value = json.dumps(json.loads(value) if isinstance(value, str) else value, sort_keys=True)
        elif self.kind == "choice":
            value = json.dumps(list(value))
        return (self.kind, str(value), self.disable_any_whitespace)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """From vLLM's request field ``structured_outputs`` (its unknown keys are refused)."""
        unknown = sorted(set(data) - set(cls.KINDS) - {"disable_any_whitespace"})
        if unknown:
            raise InvalidRequest("structured_outputs", f"has unknown field(s) {', '.join(unknown)}; it takes "
                                 + ", ".join(cls.KINDS) + ", disable_any_whitespace", "SamplingParams")
        return cls(**{k: v for k, v in data.items() if v is not None})


@dataclass(slots=True)
class SamplingParams:
    """How to sample the output of one request.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``max_tokens=None`` generates until EOS/stop or the model's context length. ``stop`` strings are
    matched on the detokenized text across token boundaries and are not part of the output.
    ``logprobs=k`` returns the sampled token's logprob plus the top-k alternatives per step;
    ``prompt_logprobs=k`` the same for every prompt token (None for the first). ``max_tokens=0``
    computes the prompt and generates nothing (finish reason "length"): prompt logprobs only.

    Token constraints, as vLLM's: ``logit_bias`` maps token ids to a bias in [-100, 100] added
    to their logits before sampling; ``allowed_token_ids`` (non-empty) are the only tokens that
    may be sampled; ``bad_words`` are strings whose token sequences may not be completed (see
    ``tokenize_bad_words``). Logprobs describe the model's raw distribution, before any of them.

    Invalid values raise ``InvalidRequest`` (a ValueError) naming the field and the values it
    accepts, at construction: every float must be finite, ``seed`` a signed 64-bit integer, at most
    ``MAX_STOP_STRINGS`` stop strings of ``MAX_STOP_STRING_CHARS`` characters each, valid Unicode,
    at most ``MAX_STOP_TOKEN_IDS`` stop token ids, ``MAX_TOKEN_ID_ENTRIES`` logit biases and
    allowed token ids, ``MAX_BAD_WORDS`` bad words of ``MAX_BAD_WORD_CHARS`` characters (not
    blank). What depends on the engine (vocabulary, context length, ``max_logprobs``) is checked
    when a request is added (``check_request``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    """The token sequences of ``bad_words``: set by the engine with its tokenizer when a request
    is added (``tokenize_bad_words``); None until then."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrained decoding: every token keeps the output a prefix of a string the grammar
    accepts, and the sequence may end (EOS) only once it is complete (a dict is read with
    ``StructuredOutputsParams.from_dict``)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidRequest`` for the first field out of its range (run at construction;
        ``check_request`` runs it again, as fields may have been set since)."""
        for name, ok, allowed in _CHECKS:
            value = getattr(self, name)
            if not ok(value):
                raise InvalidRequest(name, f"must be {allowed} (got {_shown(value)})", "SamplingParams")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"must not exceed max_tokens ({self.max_tokens}) "
                                               f"(got {self.min_tokens})", "SamplingParams")
        for stop in self.stop:
            check_text("stop", stop, "SamplingParams")
        for word in self.bad_words or ():
            check_text("bad_words", word, "SamplingParams")
        _check_logit_bias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrains_tokens(self) -> bool:
        """Whether ``logit_bias``, ``allowed_token_ids`` or bad words change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    def tokenize_bad_words(self, tokenizer) -> SamplingParams:
        """These params with ``bad_words_token_ids`` set from ``bad_words`` (itself when there is
        nothing to do), as vLLM does: each word, stripped of leading whitespace, is encoded
        without special tokens as is and after one space (``" " + word``: the same word inside a
        text); both sequences are banned, once each. A word that encodes to no token is an
        ``InvalidRequest``."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        from dataclasses import replace

        sequences: list[list[int]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if not ids:
                    raise InvalidRequest("bad_words", f"holds {_shown(word)}, which encodes to no token",
                                         "SamplingParams")
                if ids not in sequences:
                    sequences.append(ids)
        return replace(self, bad_words_token_ids=sequences)

    def child(self) -> SamplingParams:
        """The params of one of the ``n`` sequences of this request: the same, with ``n=1``."""
        from dataclasses import replace

        return replace(self, n=1)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _in(low: float, high: float) -> object:
    return lambda v: _finite(v) and low <= v <= high


def _optional(check) -> object:
    return lambda v: v is None or check(v)


def _shown(value: object) -> str:
    if isinstance(value, list) and len(value) > 8:
        return f"a list of {len(value)}"
    if _is_int(value) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_logit_bias(bias: dict[int, float] | None) -> None:
    if bias is None:
        return
    if len(bias) > MAX_TOKEN_ID_ENTRIES:
        raise InvalidRequest("logit_bias", f"must have at most {MAX_TOKEN_ID_ENTRIES} entries (got "
                             f"{len(bias)})", "SamplingParams")
    for token_id, value in bias.items():
        if not (_is_int(token_id) and token_id >= 0):
            raise InvalidRequest("logit_bias", f"keys must be token ids, non-negative integers (got "
                                 f"{_shown(token_id)})", "SamplingParams")
        if not (_finite(value) and -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX):
            raise InvalidRequest("logit_bias", f"values must be finite numbers in [-{LOGIT_BIAS_MAX:g}, "
                                 f"{LOGIT_BIAS_MAX:g}] (got {_shown(value)} for token {token_id})",
                                 "SamplingParams")


# (field, check, what it accepts)
_CHECKS = (
    ("n", lambda v: _is_int(v) and v >= 1, "an integer of at least 1"),
    ("temperature", _in(0.0, math.inf), "a finite number >= 0 (0 = greedy)"),
    ("top_p", lambda v: _finite(v) and 0.0 < v <= 1.0, "a finite number in (0, 1]"),
    ("top_k", lambda v: _is_int(v) and v >= -1, "-1 or 0 (disabled) or a positive integer"),
    ("min_p", _in(0.0, 1.0), "a finite number in [0, 1]"),
    ("presence_penalty", _in(-2.0, 2.0), "a finite number in [-2, 2]"),
    ("frequency_penalty", _in(-2.0, 2.0), "a finite number in [-2, 2]"),
    ("repetition_penalty", lambda v: _finite(v) and v > 0.0, "a finite number > 0 (1 = none)"),
    ("seed", _optional(lambda v: _is_int(v) and SEED_MIN <= v <= SEED_MAX),
     f"None or an integer in [{SEED_MIN}, {SEED_MAX}] (signed 64 bits)"),
    ("max_tokens", _optional(lambda v: _is_int(v) and v >= 0),
     "None or a non-negative integer (0: compute the prompt only)"),
    ("min_tokens", lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    ("logprobs", _optional(lambda v: _is_int(v) and v >= 0), "None or a non-negative integer"),
    ("prompt_logprobs", _optional(lambda v: _is_int(v) and v >= 0), "None or a non-negative integer"),
    ("stop", lambda v: len(v) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} strings"),
    ("stop", lambda v: all(isinstance(s, str) and s for s in v), "non-empty strings"),
    ("stop", lambda v: all(len(s) <= MAX_STOP_STRING_CHARS for s in v),
     f"strings of at most {MAX_STOP_STRING_CHARS} characters"),
    ("stop_token_ids", lambda v: len(v) <= MAX_STOP_TOKEN_IDS, f"at most {MAX_STOP_TOKEN_IDS} token ids"),
    ("stop_token_ids", lambda v: all(_is_int(t) and t >= 0 for t in v), "non-negative integers"),
    ("allowed_token_ids", _optional(lambda v: 0 < len(v) <= MAX_TOKEN_ID_ENTRIES),
     f"None or a non-empty list of at most {MAX_TOKEN_ID_ENTRIES} token ids"),
    ("allowed_token_ids", _optional(lambda v: all(_is_int(t) and t >= 0 for t in v)),
     "non-negative integers"),
    ("bad_words", _optional(lambda v: len(v) <= MAX_BAD_WORDS), f"None or at most {MAX_BAD_WORDS} strings"),
    ("bad_words", _optional(lambda v: all(isinstance(w, str) and w.strip() for w in v)),
     "strings with a non-whitespace character"),
    ("bad_words", _optional(lambda v: all(len(w) <= MAX_BAD_WORD_CHARS for w in v)),
     f"strings of at most {MAX_BAD_WORD_CHARS} characters"),
    ("bad_words_token_ids", _optional(lambda v: all(
        isinstance(ids, list) and ids and all(_is_int(t) and t >= 0 for t in ids) for ids in v)),
     "None or lists of non-negative token ids, none empty"),
    ("logit_bias", lambda v: v is None or isinstance(v, dict), "None or a dict of token id to bias"),
    ("structured_outputs", lambda v: v is None or isinstance(v, StructuredOutputsParams),
     "None or a StructuredOutputsParams (or its dict)"),
)
