"""Constrained decoding on the engine side: grammars compiled off the step, one grammar per
constrained sequence, and each step's token bitmask for the batch.

The engine process holds every grammar (the workers only apply the bitmask it sends them)::

    InputProcessor.process ── validate (parse; a refusal is InvalidRequest → HTTP 400)
    add_processed  (after the queue checks: nothing compiles before admission)
        └─ compile_for ── compile cache hit ────────────┐
                  └─ miss: CompilePool (tandem.grammar_pool)  the request waits in
                       small lane: grammars ≤ SMALL_GRAMMAR_CHARS   WAITING_FOR_GRAMMAR, outside
                       large lane: engine.grammar_compile_threads   the scheduler's queue;
                                                        ▼           aborting it drops its compile
    step: start_compiled(rid): GrammarTooComplex past engine.grammar_compile_timeout_s, or
          start(rid) once compiled ─ scheduler.grammar_compiled ─ schedule
          bitmask(scheduler_output): fork children's grammars, fill one row per
                                     constrained sequence of the step (GrammarBitmask)
          executor.execute: the sampler masks those rows (tandem.worker.structured)
          accept(rid, new tokens) for each update (GrammarTooSlow past the per-token budget);
          release(rid) when a request ends

Compiled grammars are cached by ``StructuredOutputsParams.key`` (the grammar's canonical text
and options) in a ``GrammarCache``, which one-off grammars cannot flush; a grammar that timed
out is remembered and refused at once. The backend is built when the first constrained request
needs it (it loads a tokenizer of its own and reads the whole vocabulary once: seconds on a
large vocabulary), not while the engine starts, where it would take a core from the first
requests' steps on a small machine. Constrained sequences get no speculative
drafts (the scheduler skips them), so every row is the grammar's next token.

Grammar time per token. A row's mask is filled with the others in one batch; when the batch
takes more than half the budget, each row is filled again alone and timed, so that a slow
grammar is found without timing every row of every step.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import numpy as np

from tandem.grammar_cache import GrammarCache
from tandem.grammar_pool import CompileJob, CompilePool
from tandem.interfaces import StructuredOutputBackend, StructuredOutputGrammar
from tandem.sched.output import GrammarBitmask, SchedulerOutput
from tandem.errors import InvalidRequest
from tandem.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tandem.structured_outputs")

SMALL_GRAMMAR_CHARS = 2048
"""Grammars whose canonical text is at most this long compile on a lane of their own."""
LARGE_GRAMMAR_NICE = 10
"""The large lane's threads run at this much lower CPU priority than the engine's steps and the
small lane (a nice-10 thread gets about a tenth of a contended core)."""
TOO_COMPLEX_REMEMBERED = 1024
"""Grammars that timed out, remembered (least recently seen out) to be refused at once."""
VALIDATED_REMEMBERED = 4096
"""Digests of grammars the backend accepted, so that the engine thread does not parse again a
grammar the server checked (a large schema's parse is not free)."""
OVER_BUDGET_STEPS = 3
"""Steps in a row over ``max_grammar_ms_per_token`` that finish a request (one slow step may
be the machine's, not the grammar's)."""


class GrammarTooComplex(InvalidRequest):
    """The grammar did not compile within ``engine.grammar_compile_timeout_s`` (HTTP 400
    ``grammar_too_complex``)."""

    code = "grammar_too_complex"

    def __init__(self, timeout_s: float) -> None:
        super().__init__("structured_outputs", f"is too complex: its grammar did not compile within "
                         f"{timeout_s:g} s (engine.grammar_compile_timeout_s); simplify it (fewer "
                         "properties, alternatives or repetitions)")


class GrammarTooSlow(ValueError):
    """A constrained request's grammar took more engine time per token than allowed."""

    code = "grammar_too_complex"


class StructuredOutputManager:
    """Grammars of the engine's constrained requests. ``validate`` is thread-safe; every other
    method is called from the engine thread."""

    def __init__(self, backend_cls: type[StructuredOutputBackend], load_tokenizer: Callable[[], Any],
                 vocab_size: int, stop_token_ids: frozenset[int], compile_threads: int = 2,
                 compile_timeout_s: float = 10.0, max_ms_per_token: float = 50.0) -> None:
        self.vocab_size = vocab_size
        self.backend_name = backend_cls.name or backend_cls.__name__
        self.compile_timeout_s = compile_timeout_s
        self.max_ms_per_token = max_ms_per_token
        # the backend gets a tokenizer of its own: a fast tokenizer is not safe across threads
        self._backend_args = (backend_cls, load_tokenizer, stop_token_ids)
        self._backend: Future[StructuredOutputBackend] = Future()
        self._backend_lock = threading.Lock()
        self._small = CompilePool(1, "small")
        self._large = CompilePool(compile_threads, "large", nice=LARGE_GRAMMAR_NICE)
        self._lock = threading.Lock()
        self._cache = GrammarCache()
        self._inflight: dict[tuple, CompileJob] = {}
        self._too_complex: OrderedDict[tuple, None] = OrderedDict()
        self._validated: OrderedDict[bytes, None] = OrderedDict()
        self._grammars: dict[str, StructuredOutputGrammar] = {}
        self._compiling: dict[str, CompileJob] = {}  # request id → its grammar's compile
        self._fill_ms: dict[str, float] = {}
        self._over_budget: dict[str, int] = {}

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on the calling thread by the first caller (the others wait for
        it); a build that failed raises its error to every caller."""
        if not self._backend.done():
            with self._backend_lock:
                if not self._backend.done():
                    self._build_backend(*self._backend_args)
        return self._backend.result()

    def _build_backend(self, backend_cls, load_tokenizer, stop_token_ids) -> None:
        t0 = time.perf_counter()
        try:
            self._backend.set_result(backend_cls(load_tokenizer(), self.vocab_size, stop_token_ids))
        except BaseException as exc:  # noqa: BLE001 - raised where the backend is used
            self._backend.set_exception(exc)
            return
        logger.info("structured outputs: the %s backend read the vocabulary (%d tokens) in %.1f s",
                    self.backend_name, self.vocab_size, time.perf_counter() - t0)

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``InvalidRequest`` (field ``structured_outputs``) naming what the backend
        refuses; ``GrammarTooComplex`` for a grammar that timed out before."""
        with self._lock:
            if params.key in self._too_complex:
                self._too_complex.move_to_end(params.key)
                raise GrammarTooComplex(self.compile_timeout_s)
            if params.key in self._cache:
                return
        digest = hashlib.sha256(repr(params.key).encode()).digest()
        with self._lock:
            if digest in self._validated:
                self._validated.move_to_end(digest)
                return
        try:
            self.backend.validate(params)
        except ValueError as exc:
            raise InvalidRequest("structured_outputs", f"is not a grammar the {self.backend_name} "
                                 f"backend can follow: {exc}") from None
        with self._lock:
            self._validated[digest] = None
            if len(self._validated) > VALIDATED_REMEMBERED:
                self._validated.popitem(last=False)

    # ----------------------------------------------------------------------------- compiles

    def submit(self, params: StructuredOutputsParams) -> CompileJob:
        """The compile of ``params``: done at once from the cache, shared with a compile in
        flight, or queued. Each call is one waiter: pair it with ``drop`` if its request goes
        away before the job is done."""
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                job = CompileJob(key, 0, lambda: compiled)
                job.future.set_result(compiled)
                return job
            job = self._inflight.get(key)
            if job is not None and not job.abandoned:
                job.waiters += 1
                return job
            size = len(repr(key))
            job = CompileJob(key, size, lambda: self._compile(params))
            self._inflight[key] = job
        job.future.add_done_callback(lambda _: self._on_compiled(job))
        (self._small if size <= SMALL_GRAMMAR_CHARS else self._large).submit(job)
        return job

    def compile_for(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start the compile of ``request_id``'s grammar (``start_compiled`` ends it)."""
        self._compiling[request_id] = self.submit(params)

    def start_compiled(self, request_id: str) -> bool:
        """True once ``request_id``'s grammar has compiled and started; False while it compiles.
        Raises ``GrammarTooComplex`` past the time limit and ``InvalidRequest`` when the compile
        failed."""
        job = self._compiling[request_id]
        too_complex = not job.future.done() and self.timed_out(job)
        if not (job.future.done() or too_complex):
            return False
        del self._compiling[request_id]
        if too_complex:
            raise GrammarTooComplex(self.compile_timeout_s)
        exc = job.future.exception()
        if exc is not None:
            raise InvalidRequest("structured_outputs", f"could not be compiled: {exc}")
        self.start(request_id, job.future.result())
        return True

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for one of the compiles of ``compile_for`` to end."""
        futures = {id(job): job.future for job in self._compiling.values()}
        wait(list(futures.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def drop(self, job: CompileJob) -> None:
        """A waiter of ``job`` went away; the last one cancels it (its result is not kept)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            self._forget(job)
        self._pool_of(job).cancel(job)

    def timed_out(self, job: CompileJob) -> bool:
        """True when ``job`` has been compiling longer than the time limit (it is abandoned and
        its grammar refused from now on) or was abandoned so."""
        if job.future.done():
            return False
        if job.abandoned:
            return True
        if job.started_at is None or time.monotonic() - job.started_at <= self.compile_timeout_s:
            return False
        logger.warning("a %d-character grammar did not compile within %g s; its requests fail and "
                       "it is refused from now on", job.size, self.compile_timeout_s)
        with self._lock:
            self._too_complex[job.key] = None
            if len(self._too_complex) > TOO_COMPLEX_REMEMBERED:
                self._too_complex.popitem(last=False)
            self._forget(job)
        self._pool_of(job).cancel(job)
        return True

    def _pool_of(self, job: CompileJob) -> CompilePool:
        return self._small if job.size <= SMALL_GRAMMAR_CHARS else self._large

    def _forget(self, job: CompileJob) -> None:
        if self._inflight.get(job.key) is job:
            del self._inflight[job.key]

    def _on_compiled(self, job: CompileJob) -> None:
        with self._lock:
            self._forget(job)
            if job.abandoned or job.future.cancelled() or job.future.exception() is not None:
                return
            self._cache.put(job.key, job.future.result())

    def _compile(self, params: StructuredOutputsParams) -> Any:
        t0 = time.perf_counter()
        try:
            return self.backend.compile(params)
        finally:
            logger.debug("compiled a %s grammar in %.1f ms", params.kind, (time.perf_counter() - t0) * 1e3)

    # ----------------------------------------------------------------------------- sequences

    def start(self, request_id: str, compiled: Any, output_token_ids: list[int] | tuple[int, ...] = ()) -> bool:
        """Give ``request_id`` a grammar at its start, advanced by the outputs it already has.
        False when those outputs do not follow the grammar."""
        grammar = self.backend.grammar(compiled)
        self._grammars[request_id] = grammar
        return grammar.accept_tokens(list(output_token_ids))

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance ``request_id``'s grammar (True for a request without one); False when a token
        is not allowed (the sampler had no allowed token left: see tandem.worker.sampler).
        Raises ``GrammarTooSlow`` when the grammar's time per token (this step's mask and these
        tokens) was over the budget for ``OVER_BUDGET_STEPS`` steps in a row."""
        grammar = self._grammars.get(request_id)
        if grammar is None or not token_ids or grammar.is_terminated():
            return True  # past its stop token only ``ignore_eos`` goes on: unconstrained
        t0 = time.perf_counter()
        accepted = grammar.accept_tokens(token_ids)
        ms = (time.perf_counter() - t0) * 1e3 + self._fill_ms.pop(request_id, 0.0)
        per_token = ms / len(token_ids)
        if per_token <= self.max_ms_per_token:
            self._over_budget.pop(request_id, None)
            return accepted
        steps = self._over_budget[request_id] = self._over_budget.get(request_id, 0) + 1
        if steps >= OVER_BUDGET_STEPS:
            raise GrammarTooSlow(
                f"grammar_too_complex: its grammar took {per_token:.1f} ms of engine time per token "
                f"for {steps} tokens in a row, more than engine.max_grammar_ms_per_token = "
                f"{self.max_ms_per_token:g}; the request was finished so that the other requests "
                "are not slowed (an ambiguous grammar costs more with every token: make it "
                "unambiguous)")
        return accepted

    def release(self, request_id: str) -> None:
        """``request_id`` ended: its grammar goes, and its compile when it still waits for one."""
        job = self._compiling.pop(request_id, None)
        if job is not None:
            self.drop(job)
        self._grammars.pop(request_id, None)
        self._fill_ms.pop(request_id, None)
        self._over_budget.pop(request_id, None)

    def bitmask(self, out: SchedulerOutput) -> GrammarBitmask | None:
        """This step's rows: every scheduled constrained sequence, and the children forked this
        step (their grammars are forked from the parent's, before its token of this step). A
        grammar past its stop token (a request with ``ignore_eos``) constrains nothing more."""
        for fork in out.forked_requests:
            parent = self._grammars.get(fork.parent_id)
            if parent is not None:
                self._grammars[fork.request_id] = parent.fork()
        rids = [rid for rid in out.num_scheduled_tokens if rid in self._grammars]
        rids += [f.request_id for f in out.forked_requests if f.request_id in self._grammars]
        rids = [rid for rid in rids if not self._grammars[rid].is_terminated()]
        if not rids:
            return None
        bitmask = np.zeros((len(rids), (self.vocab_size + 31) // 32), dtype=np.int32)
        grammars = [self._grammars[rid] for rid in rids]
        t0 = time.perf_counter()
        self.backend.fill_bitmasks(grammars, bitmask)
        batch_ms = (time.perf_counter() - t0) * 1e3
        if len(rids) == 1 or batch_ms <= self.max_ms_per_token / 2:
            self._fill_ms.update(dict.fromkeys(rids, batch_ms))
        else:
            for row, (rid, grammar) in enumerate(zip(rids, grammars)):
                t0 = time.perf_counter()
                grammar.fill_bitmask(bitmask, row)
                self._fill_ms[rid] = (time.perf_counter() - t0) * 1e3
        return GrammarBitmask(request_ids=rids, bitmask=bitmask)

    def close(self) -> None:
        self._small.close()
        self._large.close()
