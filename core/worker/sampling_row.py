"""One row of logits to sample: what the sampler and tandem.worker.logits_processing need to
know about the row's request (built by the model runner each step)."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice

import torch

from tandem.sampling_params import SamplingParams


class TokenSpan(Sequence[int]):
    """``tokens[start:stop] + extra`` as a read-only sequence that copies nothing: a request's
    prompt or output tokens for one step's sampling (most steps never read them; copying every
    row's context each step would cost O(context) for nothing). ``tokens`` must not change
    while the span is in use (the runner extends a request's list only between steps)."""

    __slots__ = ("_tokens", "_start", "_stop", "_extra")

    def __init__(self, tokens: list[int], start: int, stop: int, extra: Sequence[int] = ()) -> None:
        self._tokens, self._start, self._stop, self._extra = tokens, start, stop, extra

    def __len__(self) -> int:
        return self._stop - self._start + len(self._extra)

    def __iter__(self) -> Iterator[int]:
        return chain(islice(self._tokens, self._start, self._stop), self._extra)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return list(self)[index]
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("TokenSpan index out of range")
        held = self._stop - self._start
        return self._tokens[self._start + index] if index < held else self._extra[index - held]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"TokenSpan({list(self)!r})"


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample, with what its processing needs to know about its request."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    allowed: torch.Tensor | None = None  # structured outputs: bool [vocab], the tokens that may come

    @property
    def before_min_tokens(self) -> bool:
        """Whether ``min_tokens`` still bans EOS and the stop token ids."""
        return len(self.output_token_ids) < self.params.min_tokens

    @property
    def may_exclude_all(self) -> bool:
        """Whether its mask, ``allowed_token_ids`` and bans together may exclude every token."""
        p = self.params
        return (self.allowed is not None or self.before_min_tokens or p.allowed_token_ids is not None
                or bool(p.bad_words_token_ids))
