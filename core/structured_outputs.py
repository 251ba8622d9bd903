"""Constrained decoding on the engine side: grammars compiled off the step, one grammar per
constrained sequence, and each step's token bitmask for the batch.

The engine process holds every grammar (the workers only apply the bitmask it sends them)::

    add_request ── validate (parse: cheap; a refusal is InvalidRequest → HTTP 400)
        │
        └─ submit ── compile cache hit ─────────────┐
                  └─ miss: compile thread ──────────┤  the request waits in the engine's
                                                    ▼  queue, outside the scheduler
    step: start(rid) once compiled ─ scheduler.add_request ─ schedule
          bitmask(scheduler_output): fork children's grammars, fill one row per
                                     constrained sequence of the step (GrammarBitmask)
          executor.execute: the sampler masks those rows (tandem.worker.structured)
          accept(rid, new tokens) for each update; release(rid) when a request ends

Compiled grammars are cached by ``StructuredOutputsParams.key`` (the grammar's canonical text
and options), least recently used out past ``CACHE_SIZE``. The backend is built on the compile
thread when the manager is (it reads the whole vocabulary once). Constrained sequences get no
speculative drafts (the scheduler skips them), so every row is the grammar's next token.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tandem.interfaces import StructuredOutputBackend, StructuredOutputGrammar
from tandem.sched.output import GrammarBitmask, SchedulerOutput
from tandem.sched.request_checks import InvalidRequest
from tandem.sched.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tandem.structured_outputs")

CACHE_SIZE = 256
"""Compiled grammars kept (a compiled grammar of a 32k vocabulary is tens to hundreds of KiB)."""


class StructuredOutputManager:
    """Grammars of the engine's constrained requests. Every method but ``validate`` and
    ``submit`` (thread-safe) is called from the engine thread."""

    def __init__(self, backend_cls: type[StructuredOutputBackend], load_tokenizer: Callable[[], Any],
                 vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.backend_name = backend_cls.name or backend_cls.__name__
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-grammar")
        # the backend gets a tokenizer of its own: a fast tokenizer is not safe across threads
        self._backend: Future[StructuredOutputBackend] = self._pool.submit(
            lambda: backend_cls(load_tokenizer(), vocab_size, stop_token_ids))
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._grammars: dict[str, StructuredOutputGrammar] = {}

    @property
    def backend(self) -> StructuredOutputBackend:
        return self._backend.result()

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise ``InvalidRequest`` (field ``structured_outputs``) naming what the backend refuses."""
        with self._lock:
            cached = self._cache.get(params.key)
        if cached is not None and not (cached.done() and cached.exception() is not None):
            return
        try:
            self.backend.validate(params)
        except ValueError as exc:
            raise InvalidRequest("structured_outputs", f"is not a grammar the {self.backend_name} "
                                 f"backend can follow: {exc}") from None

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params``, from the cache or compiling on the compile thread."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

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
        is not allowed (the sampler had no allowed token left: see tandem.worker.sampler)."""
        grammar = self._grammars.get(request_id)
        if grammar is None or not token_ids or grammar.is_terminated():
            return True  # past its stop token only ``ignore_eos`` goes on: unconstrained
        return grammar.accept_tokens(token_ids)

    def release(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)

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
        self.backend.fill_bitmasks([self._grammars[rid] for rid in rids], bitmask)
        return GrammarBitmask(request_ids=rids, bitmask=bitmask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
