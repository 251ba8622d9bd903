"""The two messages of one engine step: what the scheduler decided, and what the runner produced.

Pure Python. The scheduler sends diffs: a request appears in full (``NewRequestData``) the first time
it is scheduled and again after a preemption; while it keeps running it appears only as its id, its
new blocks, the tokens it gained since it was last sent (those sampled, the accepted drafts) and
its progress (``CachedRequestData``). A runner's per-request state is a function of these messages
alone: every rank of a parallel executor keeps the same state, whichever of them samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first schedule, or resumed after preemption.

    ``token_ids`` holds the prompt plus every output sampled so far (recompute after preemption
    computes them all again); ``num_prompt_tokens`` says where the prompt ends.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    sample_index: int
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: the blocks appended to its table since the last step
    (``replaced_block`` = (logical index, new physical id) after a copy-on-write), the tokens
    appended since it was last sent (``new_token_ids``) and its progress."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    replaced_blocks: list[tuple[int, int]] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ForkedRequestData:
    """Sequence ``sample_index`` of a request with n > 1, forked from ``parent_id`` this step.

    The child shares the parent's block table (as it is after this step's allocation) and samples
    its first token from the parent's logits of this step; it computes no tokens this step.
    """

    request_id: str
    parent_id: str
    sample_index: int


@dataclass(slots=True)
class GrammarBitmask:
    """The tokens that constrained sequences may sample this step, set by the engine after
    ``schedule()`` (tandem.structured_outputs): ``bitmask`` row ``i`` (numpy int32, the packed
    layout of ``tandem.interfaces.StructuredOutputGrammar``) belongs to ``request_ids[i]``. A
    sequence that samples and is not listed is unconstrained."""

    request_ids: list[str]
    bitmask: object


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    ``num_scheduled_tokens[rid]`` tokens of each request are computed this step, starting at its
    ``num_computed_tokens``; their sum is ``total_num_scheduled_tokens`` (≤ max_num_batched_tokens).
    ``block_copies`` (src, dst) must be executed before the forward pass (copy-on-write of a
    shared partial block). ``finished_req_ids`` and ``preempted_req_ids`` tell the runner which
    state to drop.
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    forked_requests: list[ForkedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens of speculative decoding: a request listed here has ``1 + len(drafts)``
    scheduled tokens, its last known token followed by the drafts (not yet its tokens)."""
    grammar: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0 and not self.forked_requests


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """Logprob of the chosen token and of the top-k alternatives at one position.

    ``top`` is sorted by descending logprob, each entry (token_id, logprob, rank) with rank 1 the
    most likely; the chosen token's rank is ``rank`` (1-based, over the whole vocabulary).
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float, int], ...] = ()


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced. A request appears in ``sampled_token_ids`` when its last scheduled
    token was its last known token (it reached the end of its prompt or is decoding), and so do
    the children forked this step. Partial prompt chunks sample nothing. The list holds one token,
    or with speculative decoding the drafts the model accepted followed by one of its own.
    ``logprobs[rid]``, when asked for, has one entry per token of ``sampled_token_ids[rid]``.

    ``prompt_logprobs[rid]`` holds entries for the prompt positions computed this step (None for
    the first prompt token, which has no logprob).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
