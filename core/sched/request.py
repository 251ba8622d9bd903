"""A request as the scheduler sees it: token ids, progress, status. Pure Python (no torch).

Progress is one number: ``num_computed_tokens`` catches up with ``num_tokens`` (prompt plus the
outputs sampled so far). A new prompt, a chunk of a long prompt and a decode token are all just
"tokens to compute this step"; there are no prefill/decode phases.

A request's life is its ``status``, changed only by the scheduler's methods named here::

    add_request ──► WAITING ◄──grammar_compiled── WAITING_FOR_GRAMMAR ◄──add_request(wait_for_grammar)
                      │  ▲ finish_remote_load(ok=False): recompute
      admitted (LOAD) │  └──────────────────┐
                      ├──► WAITING_FOR_REMOTE_KV ──finish_remote_load(ok=True)──┐
             admitted │                                                         ▼
                      └────────────────────────────────────────────────────► RUNNING
    RUNNING ──short of blocks (preempted)──► PREEMPTED ──admitted──► RUNNING
    RUNNING, WAITING, PREEMPTED ──isolate_step (a failed step)──► ISOLATED ──retried alone──► RUNNING
    add_request, grammar_compiled ──could never run──► FINISHED_REJECTED
    any unfinished ──stop, length (update_from_output, finish_requests), abort_requests──► FINISHED_*

``ISOLATED``: in the scheduler's isolation queue, to be retried alone (tandem.sched.scheduler).
``remote_kv`` is not a state but the request's part in a KV hand-over; ``num_sequences`` is what
forking left it to stand for.
"""
from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


def request_cache_salt(client_salt: str | None, kv_variant: str | None) -> str | None:
    """The ``Request.cache_salt`` of a request: the client's ``cache_salt`` (a tenant's) and the
    engine's ``kv_variant`` (what makes the same tokens' KV differ, such as longrope's short or
    long factors), both in it and never confused with each other; None when neither is set."""
    if client_salt is None and kv_variant is None:
        return None
    return json.dumps([client_salt, kv_variant])


class RequestStatus(enum.IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING_FOR_GRAMMAR = 0
    WAITING = 1
    WAITING_FOR_REMOTE_KV = 2
    RUNNING = 3
    PREEMPTED = 4
    ISOLATED = 5
    FINISHED_STOPPED = 6
    FINISHED_LENGTH = 7
    FINISHED_ABORTED = 8
    FINISHED_REJECTED = 9

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason of a final status, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
}


class RemoteKV(enum.Enum):
    """A request's part in a disaggregated prefill/decode hand-over."""

    NONE = "none"
    LOAD = "load"
    """Decode side: its prompt's KV is loaded from a prefill instance when it is admitted (once:
    after a failed load it recomputes, and its ``remote_kv`` is NONE)."""
    SEND = "send"
    """Prefill side: when it finishes normally its blocks are pinned for a decode instance to
    read (``Scheduler.take_new_pins``)."""
    STREAM = "stream"
    """Prefill side, a streamed hand-over: like SEND, and its full computed blocks are announced
    while it runs (``Scheduler.stream_progress``); when it ends any other way (aborted,
    preempted, isolated) the blocks it holds are pinned too, so a read already posted never
    lands in blocks another request reuses. After a preemption it is an ordinary request."""


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0


@dataclass(eq=False, slots=True)
class Request:
    """One sequence to generate. A request with ``sampling_params.n > 1`` is forked into
    ``n`` sequences (children sharing the prompt's blocks) when its prompt is computed.

    ``eos_token_ids`` end generation unless ``sampling_params.ignore_eos``. ``max_tokens`` is the
    resolved output limit (``sampling_params.max_tokens`` or what fits the context).
    ``cache_salt``: prefix-cache blocks are shared only between requests with the same salt
    (``request_cache_salt``), and a hand-over's prompt digest covers it. ``num_sequences``: how
    many sequences it stands for, ``n`` until it has forked, then 1 (a forked child: 1).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    max_tokens: int = 16
    parent_id: str | None = None
    sample_index: int = 0
    num_sequences: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    stop_reason: int | str | None = None
    reject_reason: str | None = None
    cache_salt: str | None = None
    remote_kv: RemoteKV = RemoteKV.NONE
    num_tokens_sent: int = 0
    """How many of its tokens the runner has (0: it holds no state of the request — new, or
    preempted since)."""
    metrics: RequestMetrics = None  # type: ignore[assignment]
    _output_token_ids: list[int] = field(default_factory=list)
    _all_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self._all_token_ids = list(self.prompt_token_ids)
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.num_sequences == 0:
            self.num_sequences = 1 if self.parent_id is not None else self.sampling_params.n

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt plus outputs. Read-only by contract: use ``append_output_token`` to grow it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def fork(self, child_id: str, sample_index: int) -> Request:
        """A copy of this (prompt-complete) request as sequence ``sample_index`` of the same parent."""
        child = Request(
            request_id=child_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            priority=self.priority,
            arrival_time=self.arrival_time,
            max_tokens=self.max_tokens,
            parent_id=self.parent_id or self.request_id,
            sample_index=sample_index,
            num_sequences=1,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            cache_salt=self.cache_salt,
        )
        child.metrics = RequestMetrics(
            arrival_time=self.metrics.arrival_time,
            first_scheduled_time=self.metrics.first_scheduled_time,
            num_cached_prompt_tokens=self.metrics.num_cached_prompt_tokens,
        )
        for t in self._output_token_ids:
            child.append_output_token(t)
        return child
