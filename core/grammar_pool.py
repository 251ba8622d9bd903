"""Threads that compile grammars: smallest first, a bounded number at once, and a job that
outlives its time limit or its requests is abandoned without holding a thread hostage.

xgrammar releases the GIL while it compiles but cannot be interrupted, and a compiled grammar
is too large to hand over from another process (its serialized form is far larger, and slower
to make, than the compile itself), so compiles run on threads of the engine process::

    submit(job) ─► heap (size, order) ─► worker: set_running ─► fn() ─► future result
                        │                           │
    cancel(job) ────────┘ queued: dropped           └─ running: abandoned, replaced

``cancel`` of a running job (its requests went away, or it passed its time limit) marks its
result as unwanted and, while the pool has fewer than twice its threads, starts a replacement
thread so that the pool keeps its capacity; the thread of the abandoned job exits when the
compile returns. Threads are never more than ``2 * num_threads``.

A pool's threads may run at a lower CPU priority (``nice``, Linux: a thread's nice value is its
own and passes to the threads it starts, such as xgrammar's), so that compiles take the CPU the
engine's steps leave.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("tandem.structured_outputs")


@dataclass(slots=True, eq=False)
class CompileJob:
    """One grammar's compile, shared by the requests that wait for it (``waiters``)."""

    key: tuple
    size: int
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    waiters: int = 1
    started_at: float | None = None
    """``time.monotonic()`` when a thread took it; None while queued."""
    abandoned: bool = False
    """Its result is dropped: its requests went away or it passed its time limit."""
    replaced: bool = False


class CompilePool:
    """``num_threads`` daemon threads running ``CompileJob``s, smallest ``size`` first, each at
    niceness ``nice`` (0 leaves them at the process's)."""

    def __init__(self, num_threads: int, name: str, nice: int = 0) -> None:
        self.num_threads = num_threads
        self._name = name
        self._nice = nice
        self._heap: list[tuple[int, int, CompileJob]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._target = num_threads
        self._threads = 0
        self._closed = False
        with self._cv:
            for _ in range(num_threads):
                self._spawn()

    @property
    def num_live_threads(self) -> int:
        with self._cv:
            return self._threads

    def submit(self, job: CompileJob) -> None:
        with self._cv:
            heapq.heappush(self._heap, (job.size, next(self._order), job))
            self._cv.notify()

    def cancel(self, job: CompileJob) -> None:
        """Drop ``job``: a queued one never runs, a running one is abandoned."""
        with self._cv:
            job.abandoned = True
            if job.started_at is None:
                job.future.cancel()
            else:
                self._replace(job)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for _, _, job in self._heap:
                job.future.cancel()
            self._heap.clear()
            self._cv.notify_all()

    def _replace(self, job: CompileJob) -> None:
        if not job.replaced and not job.future.done() and self._threads < 2 * self.num_threads:
            job.replaced = True
            self._target += 1
            self._spawn()

    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"tandem-grammar-{self._name}", daemon=True).start()

    def _take(self) -> CompileJob | None:
        with self._cv:
            while True:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed:
                    self._threads -= 1
                    return None
                _, _, job = heapq.heappop(self._heap)
                if job.future.set_running_or_notify_cancel():
                    job.started_at = time.monotonic()
                    return job

    def _work(self) -> None:
        if self._nice and hasattr(os, "setpriority"):
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except OSError as exc:
                logger.debug("could not lower the priority of a compile thread: %s", exc)
        while (job := self._take()) is not None:
            try:
                job.future.set_result(job.fn())
            except BaseException as exc:  # noqa: BLE001 - the waiting requests get it
                job.future.set_exception(exc)
            with self._cv:
                if job.replaced:
                    self._target -= 1
                if self._threads > self._target:
                    self._threads -= 1
                    return
