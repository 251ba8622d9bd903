"""One row of logits to sample: what the sampler and tandem.worker.logits_processing need to
know about the row's request (built by the model runner each step)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling_params import SamplingParams


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
