"""Continuous batching: tandem's one Scheduler. Pure Python, never imports torch.

Contract: ``schedule()`` is called once per step and hands out a token budget — running requests
first (a decode token, or the next chunk of a prompt), then waiting requests in the policy's
order while budget, seats and KV blocks last; there are no prefill or decode phases. It advances
``num_computed_tokens`` by what it scheduled; ``update_from_output()`` takes the step's result
(and rejected drafts back). When blocks run out the policy names a victim, preempted by recompute.
A request's status (waiting for a grammar or remote KV, running, isolated, finished …) is its
``RequestStatus``. Why one scheduler and pluggable policies: a plugin orders and picks victims but
cannot break the KV accounting. Preemption, remote KV, pins and quarantines, speculative
decoding and step isolation: docs/architecture.md §7.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.interfaces import KVAllocation, KVAllocator, SchedulingPolicy
from tandem.sched.output import (
    CachedRequestData,
    ForkedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tandem.sched.ngram import propose_ngram
from tandem.sched.request import RemoteKV, Request, RequestStatus


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Per-step limits: sequences (a request with n > 1 counts n until it forks), tokens, and the
    context length. Without chunked prefill a prompt is computed in one step or waits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    """Speculative decoding: up to this many n-gram drafts per decode step (0 = off)."""
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "ngram_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.num_speculative_tokens < 0 or self.ngram_max < self.ngram_min:
            raise ValueError("num_speculative_tokens must be >= 0 and ngram_max >= ngram_min")


@dataclass(slots=True, frozen=True)
class RemoteKVLoad:
    """A request admitted to WAITING_FOR_REMOTE_KV. Logical blocks ``first_block ..
    first_block + len(block_ids) - 1`` of its table, physical ``block_ids``, must receive the KV
    of the same logical blocks on the prefill instance (prompt positions ``[num_cached_tokens,
    num_prompt_tokens - 1)``; ``first_block = num_cached_tokens // block_size``)."""

    request_id: str
    num_cached_tokens: int
    first_block: int
    block_ids: list[int]


@dataclass(slots=True, frozen=True)
class PinnedKV:
    """The blocks a finished request left pinned under ``pin_id`` for a decode instance to read;
    they hold the KV of ``token_ids`` computed under ``cache_salt``."""

    request_id: str
    pin_id: str
    block_ids: list[int]
    token_ids: tuple[int, ...]
    cache_salt: str | None
    complete: bool = True
    """False: a streamed hand-over that ended before its prompt was computed (aborted,
    preempted); its blocks are pinned only until the reader is done with them."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def pin_holder_id(request_id: str) -> str:
    """The holder of a finished prefill request's pinned blocks."""
    return f"{request_id}#kv-pin"


def quarantine_holder_id(request_id: str) -> str:
    """The holder of the quarantined blocks a load of ``request_id`` may still write into."""
    return f"{request_id}#kv-load"


@dataclass(slots=True)
class RequestUpdate:
    """One request's result of a step: the tokens it got and whether it finished."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@dataclass(slots=True)
class _Scheduled:
    """A request's share of the step being built; ``start`` is where its tokens start."""

    request: Request
    start: int
    num_new: int
    num_prompt_phase: int
    allocation: KVAllocation
    is_new: bool
    drafts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Step:
    token_budget: int
    num_free_seats: int
    prompt_cap: int | None
    num_prompt_tokens: int = 0
    scheduled: dict[str, _Scheduled] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    forked_from: dict[str, str] = field(default_factory=dict)
    """The sequences forked this step: child id → parent id (their tokens are the parent's)."""
    probe: Request | None = None
    """During isolation: the only request this step may schedule."""
    current: Request | None = None
    """The request being scheduled: the one a failure inside ``schedule()`` points at."""

    def num_in_flight(self, request_id: str) -> int:
        """The tokens this step computes for ``request_id`` (a forked child: its parent's)."""
        record = self.scheduled.get(self.forked_from.get(request_id, request_id))
        return record.num_new if record is not None else 0


@dataclass(slots=True)
class _RunnerNotices:
    """What the runner learns in the next step's output about requests that left the running
    batch between steps: they no longer have a status to carry it (finished) or must be
    recomputed from scratch (isolated). The scheduler's one outbox to the runner."""

    finished: set[str] = field(default_factory=set)
    """Finished requests: the runner drops their state and their generator."""
    dropped: set[str] = field(default_factory=set)
    """Running requests isolated after a failed step: the runner drops their state (the
    generator goes on)."""


_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def _is_decode(request: Request, num_remaining: int) -> bool:
    """One token left after the prompt: a decode step (not prompt-phase work)."""
    return num_remaining == 1 and request.num_output_tokens > 0


class Scheduler:
    """Owns every unfinished request (``Request.status`` says where it is): the waiting queue
    (a heap on the policy's key: WAITING, PREEMPTED), the running list (scheduling order) and the
    isolation queue (ISOLATED, in the failed steps' order). Every method runs on the engine
    thread; per step the engine calls ``schedule()``, runs the model, then
    ``update_from_output()``."""

    def __init__(self, config: SchedulerConfig, kv: KVAllocator, policy: SchedulingPolicy) -> None:
        cap = policy.max_prompt_tokens_per_step()
        if cap is not None and cap < 1:
            raise ValueError(f"scheduling policy {policy.name!r} caps prompt tokens per step at {cap}; "
                             "the cap must be at least 1 or None")
        self.config = config
        self.kv = kv
        self.policy = policy
        self._requests: dict[str, Request] = {}
        self._waiting: list[tuple[Any, int, Request]] = []
        self._running: list[Request] = []
        self._queue_seq = itertools.count()
        self._notices = _RunnerNotices()
        self._new_loads: list[RemoteKVLoad] = []  # for the engine: take_new_loads
        self._new_pins: list[PinnedKV] = []  # for the engine: take_new_pins
        self._isolated: list[Request] = []  # the isolation queue, in the failed steps' order
        self._step: _Step | None = None  # the step being built or executed
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued to run (WAITING, PREEMPTED, ISOLATED)."""
        return len(self._waiting) + sum(r.status is RequestStatus.ISOLATED for r in self._isolated)

    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request (in any status short of finished); None once it finished."""
        return self._requests.get(request_id)

    @property
    def num_isolated(self) -> int:
        """Requests queued to be retried alone after a failed step (the probe included)."""
        return len(self._isolated)

    @property
    def num_loading(self) -> int:
        """Requests in WAITING_FOR_REMOTE_KV."""
        return len(self._loading())

    def _loading(self) -> list[Request]:
        return [r for r in self._requests.values() if r.status is RequestStatus.WAITING_FOR_REMOTE_KV]

    def waiting_for_grammar(self) -> list[str]:
        """The ids of the requests in WAITING_FOR_GRAMMAR, oldest first."""
        waiting = RequestStatus.WAITING_FOR_GRAMMAR
        return [rid for rid, r in self._requests.items() if r.status is waiting]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_requests_to_step(self) -> bool:
        """Unfinished requests that are not all waiting for their grammar."""
        return any(r.status is not RequestStatus.WAITING_FOR_GRAMMAR for r in self._requests.values())

    # ------------------------------------------------------------------ admission and exits

    def add_request(self, request: Request, *, wait_for_grammar: bool = False) -> Request:
        """Enqueue ``request`` as WAITING, or reject it at once (FINISHED_REJECTED with a
        ``reject_reason``) when it could never run, even alone. Its ``remote_kv`` says its part
        in a hand-over (see the module docstring). With ``wait_for_grammar`` it is held in
        WAITING_FOR_GRAMMAR instead, unchecked, until ``grammar_compiled``. Its id is not in use:
        the engine's entry points refuse a duplicate before it gets here (``LLMEngine.add_request``
        offline, ``AsyncEngine.add_requests`` for the server)."""
        assert request.request_id not in self._requests, f"request id {request.request_id!r} is in use"
        if wait_for_grammar:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._requests[request.request_id] = request
            return request
        return self._admit_to_queue(request)

    def grammar_compiled(self, request_id: str) -> Request:
        """WAITING_FOR_GRAMMAR → WAITING (or FINISHED_REJECTED, as ``add_request`` would): the
        grammar of the live request ``request_id`` is ready."""
        request = self._requests[request_id]
        assert request.status is RequestStatus.WAITING_FOR_GRAMMAR, request.status
        del self._requests[request_id]
        return self._admit_to_queue(request)

    def _admit_to_queue(self, request: Request) -> Request:
        reason = self._reject_reason(request)
        if reason is not None:
            return self._reject(request, reason)
        request.status = RequestStatus.WAITING
        self._enqueue(request)  # first: a policy that raises leaves nothing behind
        self._requests[request.request_id] = request
        return request

    def _reject(self, request: Request, reason: str) -> Request:
        request.status = RequestStatus.FINISHED_REJECTED
        request.reject_reason = reason
        request.metrics.finished_time = time.monotonic()
        return request

    def take_new_loads(self) -> list[RemoteKVLoad]:
        """The requests admitted to WAITING_FOR_REMOTE_KV since the last call."""
        loads, self._new_loads = self._new_loads, []
        return loads

    def finish_remote_load(self, request_id: str, ok: bool, quarantine: bool = False) -> None:
        """The load of the live request ``request_id`` (in WAITING_FOR_REMOTE_KV) ended: on
        success it joins the running batch with ``num_prompt_tokens - 1`` tokens computed; on
        failure its blocks are freed — or quarantined with ``quarantine``, when the
        read may still write into them — and it waits again as an ordinary request."""
        request = self._requests[request_id]
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KV, request.status
        if ok:
            request.num_computed_tokens = request.num_prompt_tokens - 1
            request.status = RequestStatus.RUNNING
            self._running.append(request)
            return
        if quarantine:
            self._keep_blocks(request_id, quarantine_holder_id(request_id))
        self.kv.free(request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def take_new_pins(self) -> list[PinnedKV]:
        """The pins made since the last call."""
        pins, self._new_pins = self._new_pins, []
        return pins

    def release_blocks(self, holder_id: str) -> bool:
        """Free the blocks of a pin or a quarantine, kept under ``holder_id``; False, and nothing
        done, when it holds none."""
        if not self.kv.get_block_ids(holder_id):
            return False
        self.kv.free(holder_id)
        return True

    def _keep_blocks(self, request_id: str, holder_id: str) -> list[int]:
        """Keep ``request_id``'s blocks under ``holder_id`` too (one more reference each)."""
        if self.kv.get_block_ids(request_id):
            self.kv.fork(request_id, holder_id)
        return self.kv.get_block_ids(holder_id)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort the given requests and the sequences forked from them; unknown or finished ids
        are ignored. Safe between ``schedule()`` and ``update_from_output()``: the tokens of the
        step in flight are then treated as never computed."""
        ids = set(request_ids)
        aborted = [r for r in self._requests.values() if r.request_id in ids or r.parent_id in ids]
        for request in aborted:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return aborted

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End the given unfinished requests with a final ``status`` (e.g. a stop string matched)."""
        assert status.is_finished, f"{status!r} is not a final status"
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _reject_reason(self, request: Request) -> str | None:
        cfg, kv = self.config, self.kv
        n, prompt, max_tokens = request.num_sequences, request.num_prompt_tokens, request.max_tokens
        if prompt + max_tokens > cfg.max_model_len:
            return (f"the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                    f"context length ({cfg.max_model_len} tokens); shorten the prompt or lower "
                    "max_tokens")
        num_blocks = kv.blocks_for(prompt + max_tokens) + (n - 1) * (kv.blocks_for(max_tokens) + 1)
        if num_blocks > kv.num_usable_blocks:
            return (f"the request needs {num_blocks} KV blocks at its longest but the KV cache holds "
                    f"{kv.num_usable_blocks}; shorten the prompt, lower max_tokens or n, or give the "
                    "engine more KV cache")
        if n > cfg.max_num_seqs:
            return f"n={n} exceeds max_num_seqs={cfg.max_num_seqs}; lower n"
        if not cfg.enable_chunked_prefill and prompt > cfg.max_num_batched_tokens:
            return (f"the prompt ({prompt} tokens) exceeds max_num_batched_tokens "
                    f"({cfg.max_num_batched_tokens}) and chunked prefill is disabled; shorten the "
                    "prompt, raise max_num_batched_tokens or enable chunked prefill")
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        rid = request.request_id
        was_running = request.status is RequestStatus.RUNNING
        if was_running:
            self._running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            self._keep_blocks(rid, quarantine_holder_id(rid))  # its read still writes into them
        elif request.status in _QUEUED:
            self._unqueue(request)
        if request in self._isolated:
            self._isolated.remove(request)
        if self._step is not None:
            request.num_computed_tokens -= self._step.num_in_flight(rid)
        request.status = status
        request.metrics.finished_time = time.monotonic()
        finished_normally = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if request.remote_kv in (RemoteKV.SEND, RemoteKV.STREAM) and was_running and finished_normally:
            self._pin(request, complete=True)
        elif request.remote_kv is RemoteKV.STREAM:
            self._pin(request, complete=False)
        self.kv.free(rid)
        del self._requests[rid]
        self._notices.finished.add(rid)

    def _pin(self, request: Request, complete: bool) -> None:
        """Keep the blocks of a sender (SEND or STREAM) for its reader; after that it sends
        nothing more."""
        rid = request.request_id
        pin_id = pin_holder_id(rid)
        tokens = tuple(request.all_token_ids[:request.num_computed_tokens])
        self._new_pins.append(PinnedKV(rid, pin_id, self._keep_blocks(rid, pin_id), tokens,
                                       request.cache_salt, complete))
        request.remote_kv = RemoteKV.NONE

    def stream_progress(self) -> list[tuple[str, list[int]]]:
        """(request id, the blocks whose every token's KV is computed) of each running STREAM
        request, in logical order; call after ``update_from_output``. Full blocks are never
        replaced, so each list extends the one before it."""
        size = self.kv.block_size
        return [(r.request_id, self.kv.get_block_ids(r.request_id)[:r.num_computed_tokens // size])
                for r in self._running if r.remote_kv is RemoteKV.STREAM]

    def _enqueue(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.policy.sort_key(request), next(self._queue_seq), request))

    def _unqueue(self, request: Request) -> None:
        self._waiting = [e for e in self._waiting if e[2] is not request]
        heapq.heapify(self._waiting)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Plan one step and advance each scheduled request's ``num_computed_tokens`` by its
        scheduled count (the output carries the values from before)."""
        step = self._step = _Step(
            token_budget=self.config.max_num_batched_tokens,
            num_free_seats=self.config.max_num_seqs - sum(
                r.num_sequences for r in (*self._running, *self._loading())),
            prompt_cap=self.policy.max_prompt_tokens_per_step(),
            probe=self._probe(),
        )
        self._schedule_running(step)
        if not step.preempted or step.probe is not None:
            self._schedule_waiting(step)
        step.current = None
        forked = self._fork_completed_prompts(step)
        return self._build_output(step, forked)

    def _probe(self) -> Request | None:
        """The head of the isolation queue (None: not isolating)."""
        return self._isolated[0] if self._isolated else None

    def isolate_step(self) -> list[str]:
        """After the step being scheduled or executed raised: its tokens count as never
        computed. Returns the client request ids to fail — the one request every sequence of the
        step belongs to, when there is one — and queues every other sequence of the step for
        isolation (preempted by recompute). Between this call and the next ``schedule()`` the
        runner must not see this step's output."""
        step, self._step = self._step, None
        if step is None:
            return []
        in_step = [*step.scheduled, *step.forked_from]
        suspects = [self._requests[rid] for rid in in_step if rid in self._requests]
        current = step.current
        if current is not None and current not in suspects and current.request_id in self._requests:
            suspects.append(current)
        for request in suspects:
            request.num_computed_tokens -= step.num_in_flight(request.request_id)
        roots = {r.parent_id or r.request_id for r in suspects}
        if len(roots) == 1:
            return list(roots)
        for request in suspects:
            self._isolate(request)
        return []

    def _isolate(self, request: Request) -> None:
        """RUNNING, WAITING or PREEMPTED → ISOLATED, at the end of the isolation queue (a running
        one is preempted by recompute, and the runner told to drop its state)."""
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._reset(request)
            self._notices.dropped.add(request.request_id)
        elif request.status in _QUEUED:
            self._unqueue(request)  # when the admission that raised had not taken it off already
        else:
            return
        request.status = RequestStatus.ISOLATED
        self._isolated.append(request)

    def _schedule_running(self, step: _Step) -> None:
        """Give each running request its next tokens, preempting the policy's victims until its
        blocks fit. A request that has to preempt itself ends the pass: the pool is exhausted."""
        for request in list(self._running):
            if step.token_budget == 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            if step.probe is not None and request is not step.probe:
                continue
            step.current = request
            num_remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(num_remaining, self._token_limit(step, request, num_remaining))
            if num_new == 0:
                continue
            drafts = self._drafts(step, request, num_remaining)
            allocation = self.kv.allocate(request, num_new + len(drafts)) if drafts else None
            if allocation is None:
                drafts = []
                allocation = self.kv.allocate(request, num_new)
            while allocation is None:
                victim = self.policy.select_victim(self._victims(step))
                self._preempt(victim, step)
                if victim is request:
                    return
                allocation = self.kv.allocate(request, num_new)
            is_new = request.num_tokens_sent == 0
            self._record(step, request, 0, num_new + len(drafts), allocation, is_new=is_new, drafts=drafts)

    def _victims(self, step: _Step) -> list[Request]:
        """The running requests a preemption may pick: during isolation not the probe, which
        alone runs, unless it is the only one (then the pool cannot hold even it now)."""
        others = [r for r in self._running if r is not step.probe]
        return others if step.probe is not None and others else self._running

    def _drafts(self, step: _Step, request: Request, num_remaining: int) -> list[int]:
        """N-gram drafts for a decoding sequence, as many as the token budget, its max_tokens
        (the accepted drafts plus the model's own token must not pass it) and the context length
        allow."""
        cfg = self.config
        if (cfg.num_speculative_tokens == 0 or not _is_decode(request, num_remaining)
                or request.sampling_params.structured_outputs is not None):
            return []
        limit = min(cfg.num_speculative_tokens, step.token_budget - 1,
                    request.max_tokens - request.num_output_tokens - 1,
                    cfg.max_model_len - request.num_tokens)
        return propose_ngram(request.all_token_ids, limit, cfg.ngram_min, cfg.ngram_max) if limit > 0 else []

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit from the head of the queue until one does not fit (no skipping ahead). A request
        preempted in this step is not readmitted in it."""
        if step.probe is not None:
            self._admit_probe(step)
            return
        while self._waiting and step.token_budget > 0:
            entry = heapq.heappop(self._waiting)
            request = entry[2]
            step.current = request
            admitted = (
                request.request_id not in step.preempted
                and request.num_sequences <= step.num_free_seats
                and self._try_admit(step, request)
            )
            if not admitted:
                heapq.heappush(self._waiting, entry)
                return

    def _admit_probe(self, step: _Step) -> None:
        """During isolation, admit the probe if it waits: ISOLATED, or preempted since its
        retry began (then wherever it is in the waiting queue)."""
        probe = step.probe
        if probe.status in _QUEUED:
            self._unqueue(probe)
        elif probe.status is not RequestStatus.ISOLATED:
            return
        step.current = probe
        if not self._try_admit(step, probe) and probe.status in _QUEUED:
            self._enqueue(probe)

    def _try_admit(self, step: _Step, request: Request) -> bool:
        """Prefix lookup, then allocation, preempting running requests while the policy allows."""
        num_cached = self.kv.get_num_cached_tokens(request)
        if request.remote_kv is RemoteKV.LOAD:
            return self._admit_remote(step, request, num_cached)
        num_new = self._num_admitted_tokens(step, request, request.num_tokens - num_cached)
        if num_new == 0:
            return False
        allocation = self._allocate_for_admission(step, request, num_new, num_cached)
        if allocation is None:
            return False
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        self._on_admitted(step, request, num_cached)
        self._record(step, request, num_cached, num_new, allocation, is_new=True)
        return True

    def _admit_remote(self, step: _Step, request: Request, num_cached: int) -> bool:
        """Blocks for prompt positions ``0 .. P-2`` (none computed this step), then
        WAITING_FOR_REMOTE_KV until ``finish_remote_load``."""
        num_to_load = request.num_prompt_tokens - 1 - num_cached
        if self._allocate_for_admission(step, request, num_to_load, num_cached) is None:
            return False
        rid = request.request_id
        request.remote_kv = RemoteKV.NONE  # loaded once: a failed load recomputes
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_cached
        self._on_admitted(step, request, num_cached)
        first_block = num_cached // self.kv.block_size
        self._new_loads.append(RemoteKVLoad(rid, num_cached, first_block,
                                            self.kv.get_block_ids(rid)[first_block:]))
        return True

    def _allocate_for_admission(self, step: _Step, request: Request, num_new: int,
                                num_cached: int) -> KVAllocation | None:
        allocation = self.kv.allocate(request, num_new, num_cached)
        while allocation is None and self._running:
            victim = self.policy.select_victim(self._running)
            if request is not step.probe and not self.policy.should_preempt_for(request, victim):
                return None
            self._preempt(victim, step)
            allocation = self.kv.allocate(request, num_new, num_cached)
        return allocation

    def _on_admitted(self, step: _Step, request: Request, num_cached: int) -> None:
        step.num_free_seats -= request.num_sequences
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
            request.metrics.num_cached_prompt_tokens = num_cached

    def _token_limit(self, step: _Step, request: Request, num_remaining: int) -> int:
        """Tokens ``request`` may get now: the budget left, and for prompt-phase work also what
        is left under the policy's prompt cap."""
        limit = step.token_budget
        if step.prompt_cap is not None and not _is_decode(request, num_remaining):
            limit = min(limit, step.prompt_cap - step.num_prompt_tokens)
        return max(limit, 0)

    def _num_admitted_tokens(self, step: _Step, request: Request, num_remaining: int) -> int:
        """With chunked prefill, as many as the limits allow. Without it, all or nothing, and a
        whole prompt is admitted while the step's prompt tokens are under the cap — except a
        resumed request longer than the whole budget, which could never run again otherwise."""
        limit = self._token_limit(step, request, num_remaining)
        if self.config.enable_chunked_prefill or num_remaining > self.config.max_num_batched_tokens:
            return min(num_remaining, limit)
        return num_remaining if limit > 0 and num_remaining <= step.token_budget else 0

    def _record(self, step: _Step, request: Request, num_cached: int, num_new: int,
                allocation: KVAllocation, is_new: bool, drafts: list[int] | None = None) -> None:
        start = request.num_computed_tokens + num_cached
        num_prompt_phase = 0 if _is_decode(request, request.num_tokens - start) else num_new
        step.scheduled[request.request_id] = _Scheduled(request, start, num_new, num_prompt_phase,
                                                        allocation, is_new, drafts or [])
        step.token_budget -= num_new
        step.num_prompt_tokens += num_prompt_phase
        request.num_computed_tokens = start + num_new

    def _preempt(self, victim: Request, step: _Step) -> None:
        """Preempt by recompute; a victim scheduled earlier in this step gives its tokens back
        (its ``num_computed_tokens`` goes back first, so the allocator caches only computed KV)."""
        record = step.scheduled.pop(victim.request_id, None)
        if record is not None:
            step.token_budget += record.num_new
            step.num_prompt_tokens -= record.num_prompt_phase
            victim.num_computed_tokens = record.start
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._running.remove(victim)
        step.num_free_seats += victim.num_sequences
        step.preempted.add(victim.request_id)
        self._requeue(victim)

    def _requeue(self, request: Request) -> None:
        """RUNNING → PREEMPTED: back to the waiting queue with nothing computed (the caller took
        it off the running list and gave back its tokens in flight)."""
        self._reset(request)
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request)

    def _reset(self, request: Request) -> None:
        """Nothing computed, nothing sent: its computed full blocks stay cached (a STREAM
        request's stay pinned: a reader may be reading them)."""
        if request.remote_kv is RemoteKV.STREAM:
            self._pin(request, complete=False)
        self.kv.free(request.request_id)
        request.num_tokens_sent = 0
        request.num_computed_tokens = 0

    def _fork_completed_prompts(self, step: _Step) -> list[ForkedRequestData]:
        """Fork every not-yet-forked request with n > 1 whose prompt this step completes. Done
        after all preemptions, so a fork is never undone; the seats were held from admission."""
        forked = []
        for record in list(step.scheduled.values()):
            parent = record.request
            if parent.num_sequences == 1 or parent.num_computed_tokens < parent.num_prompt_tokens:
                continue
            parent.num_sequences = 1
            for index in range(1, parent.sampling_params.n):
                child = parent.fork(f"{parent.request_id}#{index}", index)
                child.num_tokens_sent = child.num_tokens  # the runner copies the parent's
                self.kv.fork(parent.request_id, child.request_id)
                self._requests[child.request_id] = child
                step.forked_from[child.request_id] = parent.request_id  # computed by its step
                self._running.append(child)
                forked.append(ForkedRequestData(child.request_id, parent.request_id, index))
        return forked

    def _build_output(self, step: _Step, forked: list[ForkedRequestData]) -> SchedulerOutput:
        notices, self._notices = self._notices, _RunnerNotices()
        out = SchedulerOutput(
            forked_requests=forked,
            finished_req_ids=notices.finished,
            preempted_req_ids=step.preempted | notices.dropped,
        )
        for request_id, record in step.scheduled.items():
            request, allocation = record.request, record.allocation
            sent, request.num_tokens_sent = request.num_tokens_sent, request.num_tokens
            if record.is_new:
                out.new_requests.append(NewRequestData(
                    request_id=request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    sample_index=request.sample_index,
                    block_ids=self.kv.get_block_ids(request_id),
                    num_computed_tokens=record.start,
                ))
            else:
                out.cached_requests.append(CachedRequestData(
                    request_id=request_id,
                    new_block_ids=allocation.new_block_ids,
                    num_computed_tokens=record.start,
                    replaced_blocks=allocation.replaced_blocks,
                    new_token_ids=request.all_token_ids[sent:],
                ))
            out.num_scheduled_tokens[request_id] = record.num_new
            if record.drafts:
                out.spec_token_ids[request_id] = record.drafts
            out.block_copies.extend(allocation.block_copies)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        return out

    # ------------------------------------------------------------------ results

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestUpdate]:
        """Append each sampled token, then check, in order: EOS, stop token ids (both only once
        ``min_tokens`` are out), ``max_tokens``, the context length. A finished request frees
        its blocks at once. Tokens for requests aborted meanwhile are dropped, and so is the
        token of a request with ``max_tokens == 0``, which finishes ("length") once its prompt
        is computed."""
        self._step = None
        now = time.monotonic()
        updates = []
        for request_id, token_ids in result.sampled_token_ids.items():
            request = self._requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            drafts = out.spec_token_ids.get(request_id)
            if drafts:
                # KV is valid for the last known token and the accepted drafts only.
                request.num_computed_tokens -= 1 + len(drafts) - len(token_ids)
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
            if request.max_tokens == 0:  # the prompt alone was asked for: its token is dropped
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                updates.append(RequestUpdate(request, [], True))
                continue
            status, appended = None, []
            for token_id in token_ids:
                request.append_output_token(token_id)
                appended.append(token_id)
                status = self._stop_status(request, token_id)
                if status is not None:
                    # stopped on an accepted draft: its KV was computed, the rest is dropped
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens)
                    self._finish(request, status)
                    break
            updates.append(RequestUpdate(request, appended, status is not None))
            if self._isolated and self._isolated[0] is request:
                self._isolated.pop(0)  # the probe sampled: its retry is over
        return updates

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
