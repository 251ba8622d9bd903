"""Incremental detokenization of one output sequence, with stop strings.

Decoding token by token is wrong for most tokenizers: a character may span several byte-level
tokens, and SentencePiece-style decoders drop the leading space of the first token they see. So each
step decodes a small window instead::

    token ids:  ... prompt ... | out_0 out_1 ... out_k | new tokens
                               ^ prefix_offset         ^ read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    window_text = decode(ids[prefix_offset:])
    new text    = window_text[len(prefix_text):]

The new text is released only when ``window_text`` does not end in U+FFFD (the decoder's mark for an
incomplete UTF-8 sequence: the rest of the character is still to come); then the window moves on
(prefix_offset ← read_offset, read_offset ← end). The first window reaches a few tokens into the
prompt, so the first output token decodes in context (a prompt is expected to end on a character
boundary, as tokenized text does).

Stop strings are matched on the decoded output text, across token boundaries. Text that could be
the beginning of a stop string is held back until it is clear, so a delta never contains text that
a later stop match removes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


def raw_decoder(tokenizer: Any) -> Any:
    """The ``tokenizers`` library's own ``decode`` behind an HF fast tokenizer whose ``decode``
    without space clean-up is exactly that call (transformers' wrappers, which convert the ids and
    dispatch on their type, cost more than the decode of a few tokens each step); None for any
    other tokenizer (a slow one, or a class that overrides decoding)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its decode
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend) or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode):
        return None
    return getattr(getattr(tokenizer, "_tokenizer", None), "decode", None)


@dataclass(slots=True, frozen=True)
class DetokenizerDelta:
    """Text released by one call, and the stop string that matched in it (None if none did)."""

    new_text: str
    stop_matched: str | None = None


class IncrementalDetokenizer:
    """Turns the output tokens of one sequence into text deltas.

    ``tokenizer`` is any HF tokenizer with ``decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=...)`` (spaces are never cleaned up: that rewrites text across
    window boundaries). Call ``add_tokens`` once per step with the tokens sampled for this sequence,
    and ``flush`` once when generation ends for another reason than a stop string (EOS, stop token,
    length); after a delta with ``stop_matched`` set, the sequence is over and neither may be called.

    ``text`` is the concatenation of all deltas so far. With ``include_stop_str_in_output`` it ends
    with the matched stop string; otherwise it stops right before it. Text decoded after the stop
    string (in the same token) is dropped. When several stop strings match in one step, the one that
    starts first wins; at equal starts, the one listed first.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._raw_decode = raw_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(stop)
        assert all(self._stops), "stop strings must be non-empty"
        self._include_stop = include_stop_str_in_output
        self._token_ids = list(prompt_token_ids)
        self._read_offset = len(self._token_ids)
        self._prefix_offset = self._first_window_start()
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self._decoded = ""
        self._text = ""
        self._done = False

    @property
    def text(self) -> str:
        """The output text released so far (the concatenation of every delta)."""
        return self._text

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizerDelta:
        """Appends this step's tokens; returns the text that became final, possibly empty."""
        assert not self._done, "the sequence already ended"
        self._token_ids.extend(token_ids)
        return self._release(self._decode_window(final=False), final=False)

    def flush(self) -> DetokenizerDelta:
        """Ends the sequence: releases held-back text and the text of any incomplete character
        (as the decoder renders it). A stop string may still match in that text."""
        assert not self._done, "the sequence already ended"
        self._done = True
        return self._release(self._decode_window(final=True), final=True)

    def _first_window_start(self) -> int:
        """A few tokens before the end of the prompt, past tokens that decode to the tail of a
        character begun further back (some decoders render a run of bytes as all U+FFFD if its
        start is missing, which would swallow the characters the output completes)."""
        start = max(0, self._read_offset - _PROMPT_CONTEXT_TOKENS)
        while start < self._read_offset:
            if not self._decode(start, self._read_offset).startswith(_INCOMPLETE):
                break
            start += 1
        return start

    def _decode(self, start: int, end: int) -> str:
        if self._raw_decode is not None:
            return self._raw_decode(self._token_ids[start:end], skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            self._token_ids[start:end],
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_window(self, final: bool) -> str:
        """The new text of the window, moving it on; "" while a character is incomplete."""
        window_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(window_text) <= len(self._prefix_text):
            return ""
        if window_text.endswith(_INCOMPLETE) and not final:
            return ""
        new_text = window_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return new_text

    def _release(self, new_text: str, final: bool) -> DetokenizerDelta:
        if not new_text and not final:
            return DetokenizerDelta("")
        searched_up_to = len(self._decoded)
        self._decoded += new_text
        match = self._find_stop(searched_up_to)
        if match is not None:
            start, stop = match
            self._done = True
            return self._emit(start + len(stop) if self._include_stop else start, stop)
        if final or self._include_stop:
            return self._emit(len(self._decoded))
        return self._emit(len(self._decoded) - self._stop_prefix_length())

    def _emit(self, end: int, stop: str | None = None) -> DetokenizerDelta:
        assert end >= len(self._text), "released text is never taken back"
        delta = self._decoded[len(self._text) : end]
        self._text += delta
        return DetokenizerDelta(delta, stop)

    def _find_stop(self, searched_up_to: int) -> tuple[int, str] | None:
        """The first stop string occurrence that ends after ``searched_up_to`` (earlier ones would
        have matched before): (start, stop string), or None."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = self._decoded.find(stop, max(0, searched_up_to - len(stop) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the decoded text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(self._decoded)), longest, -1):
                if self._decoded.endswith(stop[:length]):
                    longest = length
                    break
        return longest
