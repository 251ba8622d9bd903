"""What the "mp" executor and its ranks send each other, one dataclass per kind of message.

Down (engine → rank 0 over the pipe, rank 0 → every rank over the sealed channel): a pickled
``SchedulerOutput`` (a step), a pickled ``KVCall``, or ``STOP``. Up (each rank's reply, combined by
rank 0 into one ``Reply`` for the engine)::

    start-up     Ready(info)          the worker is built
                 StartFailed(message) it could not be: the process exits 1
    each step    StepDone(output, worker_seconds)
                 StepFailed(error)    every rank failed the step in its Python code: the engine
                                      isolates it as in one process
                 KVDone(results)      a KVCall's results, in rank order
                 Fatal(message)       a collective failed or the ranks are out of step: the
                                      engine dies
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.sched.output import ModelRunnerOutput
from tandem.worker.worker import WorkerInfo

STOP = b""
"""The step message that ends the loop (also sent by rank 0 when its pipe closes)."""


@dataclass(slots=True)
class KVCall:
    """A step message that calls a method of every rank's KV connector: rank r runs
    ``connector.<method>(*args[r])`` ("connect" builds the connector and returns its
    handshake, "ping" only checks that every rank answers)."""

    method: str
    args: list[tuple]


@dataclass(slots=True, frozen=True)
class Ready:
    info: WorkerInfo


@dataclass(slots=True, frozen=True)
class StartFailed:
    message: str


@dataclass(slots=True, frozen=True)
class StepDone:
    output: ModelRunnerOutput | None
    """The driver rank's; None from the others."""
    worker_seconds: float
    """The rank's compute time; once combined, the slowest rank's."""


@dataclass(slots=True, frozen=True)
class StepFailed:
    error: BaseException


@dataclass(slots=True, frozen=True)
class KVDone:
    results: list[Any]
    """One per rank, in rank order (a single rank's reply holds its own)."""


@dataclass(slots=True, frozen=True)
class Fatal:
    message: str


Reply = Ready | StartFailed | StepDone | StepFailed | KVDone | Fatal
