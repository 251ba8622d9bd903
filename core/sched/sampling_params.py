"""Sampling parameters of one request, shaped like vLLM's so that users' scripts carry over.

Pure Python: the scheduler side imports this, so it must never import torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How to sample the output of one request.

    ``temperature == 0`` means greedy. ``top_k <= 0`` and ``top_p == 1`` disable those filters.
    ``max_tokens=None`` generates until EOS/stop or the model's context length. ``stop`` strings are
    matched on the detokenized text across token boundaries and are not part of the output.
    ``logprobs=k`` returns the sampled token's logprob plus the top-k alternatives per step.
    Invalid values raise ``ValueError`` naming the field, at construction.
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
    structured_output: str | None = None
    """"json_object": every token keeps the output a prefix of one JSON object, and the sequence
    may end (EOS) only once the object is complete (JSON mode; see tandem.sched.json_grammar)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "must be -1, 0 (disabled) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be non-negative"),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             "must be non-negative"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers"),
            (self.structured_output in (None, "json_object"), "structured_output",
             "must be None or 'json_object'"),
        ]
        for ok, name, msg in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {msg} (got {getattr(self, name)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child(self) -> SamplingParams:
        """The params of one of the ``n`` sequences of this request: the same, with ``n=1``."""
        from dataclasses import replace

        return replace(self, n=1)
