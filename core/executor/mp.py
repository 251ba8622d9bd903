"""The "mp" executor: one worker process per rank (``python -m tandem.executor``, started by
tandem.executor.ranks), the default when tensor or pipeline parallelism is asked for.

The engine process keeps the scheduler; it starts this host's ranks (``parallel.world_size /
parallel.nnodes`` of them; other hosts start theirs with ``tandem serve --headless``), talks to
rank 0 over a pipe and watches every local process (tandem.executor.worker_process has the
protocol). ``execute`` sends the step and waits for rank 0's reply:

- a local rank that exits, a reply later than ``engine.worker_timeout_s``, or a fatal reply (a
  collective failed, ranks out of step) raise ``EngineDeadError``: the instance goes not-ready
  and ``tandem serve`` exits 1; the remaining ranks are terminated;
- a step every rank failed in its Python code raises that exception, which the engine isolates
  as it does in one process.

Every rank proves it holds the launch's key before it is sent anything (tandem.executor.rank_auth):
on one host a random key made here, across hosts the cluster secret
``disaggregation.kv_transfer_secret``.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import pickle
import socket
import threading
import time
from tandem.config import ConfigError, TandemConfig
from tandem.executor.messages import STOP, Fatal, KVCall, KVDone, Ready, Reply, StartFailed, StepDone, StepFailed
from tandem.executor.rank_auth import cluster_key
from tandem.executor.ranks import start_ranks
from tandem.interfaces import Executor, KVConnector
from tandem.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("tandem")
HEALTH_PING_S = 5.0
FATAL_EXIT_GRACE_S = 1.0  # how long a failed collective waits to learn whether a local rank died


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    name = "mp"

    def __init__(self, config: TandemConfig, eos_token_ids: frozenset[int]) -> None:
        from tandem.errors import EngineDeadError

        par = config.parallel
        if par.node_rank != 0:
            raise ConfigError(f"parallel.node_rank = {par.node_rank}: the other hosts run "
                              "`tandem serve --headless`; the head (node_rank 0) runs the engine")
        key = cluster_key(config)
        config = config.model_copy(deep=True)
        if par.master_port == 0:
            config.parallel.master_port = free_port(par.master_addr)
        self.timeout_s = config.engine.worker_timeout_s
        self.world_size = par.world_size
        self.tp_size, self.pp_size = par.tensor_parallel_size, par.pipeline_parallel_size
        self.nnodes = par.nnodes
        self._last_ping = time.monotonic()
        self.procs, self.conn = start_ranks(config, eos_token_ids, 0, key, with_pipe=True)
        self._channel = threading.Lock()
        """Held from a request's send to its reply: rank 0 answers in order, so a caller on
        another thread (a KV connector call beside a step) must not read the other's reply."""
        self._closed = False
        self.step_seconds = 0.0
        """Round trip of the last step, in the engine process."""
        self.worker_seconds = 0.0
        """The slowest rank's compute time of the last step (the rest is the channel's)."""
        logger.info("mp executor: %d ranks (tp=%d, pp=%d) on %d host(s), rendezvous at %s:%d",
                    par.world_size, par.tensor_parallel_size, par.pipeline_parallel_size, par.nnodes,
                    par.master_addr, config.parallel.master_port)
        try:
            reply = self._wait(None, "start-up")
        except EngineDeadError as exc:
            raise RuntimeError(f"the mp executor could not start: {exc}") from None
        if not isinstance(reply, Ready):
            self.close()
            assert isinstance(reply, StartFailed), reply
            raise RuntimeError(f"the mp executor could not start: {reply.message}")
        self.info = reply.info

    @property
    def num_kv_blocks(self) -> int:
        return self.info.num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        from tandem.errors import EngineDeadError

        if self._closed:
            raise EngineDeadError("the mp executor's workers are stopped")
        t0 = time.perf_counter()
        reply = self._request(scheduler_output, "a step")
        self.step_seconds = time.perf_counter() - t0
        match reply:
            case StepDone(output, worker_seconds):
                self.worker_seconds = worker_seconds
                return output
            case StepFailed(error):
                raise error
            case Fatal(message):
                self._fatal(message, "a step")
        raise AssertionError(f"a step was answered with {reply!r}")

    def connect_kv(self, connector_name: str, compat_hash: str) -> KVConnector:
        """Every rank registers its slice of the KV pool with its own connector; the engine
        drives them all through one ``RankedConnector``."""
        from tandem.executor.kv_proxy import RankedConnector

        handshakes = self.call_ranks("connect", [(connector_name, compat_hash)] * self.world_size)
        return RankedConnector(self.call_ranks, handshakes, self.tp_size, self.pp_size)

    def check_health(self) -> None:
        """A local rank that exited is found at once (its sentinel); ranks on other hosts are
        pinged through the channel every ``HEALTH_PING_S`` seconds (a dead host breaks the
        gloo group)."""
        if self._closed:
            return
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            with self._channel:
                self._wait(0, "an idle period")  # names them and raises EngineDeadError
        if self.nnodes > 1 and time.monotonic() - self._last_ping >= HEALTH_PING_S:
            self._last_ping = time.monotonic()
            self.call_ranks("ping", [()] * self.world_size)

    def call_ranks(self, method: str, args: list[tuple]) -> list:
        """``connector.<method>(*args[r])`` on every rank r; their results in rank order. An
        exception of a rank is raised here; a dead or hung rank is an ``EngineDeadError``."""
        if self._closed:
            self._die("the mp executor's workers are stopped")
        reply = self._request(KVCall(method, args), f"a KV connector call ({method})")
        match reply:
            case KVDone(results):
                return results
            case StepFailed(error):
                raise error
            case Fatal(message):
                self._fatal(message, f"a KV connector call ({method})")
        raise AssertionError(f"a KV connector call was answered with {reply!r}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.conn.send_bytes(STOP)
        except OSError:
            pass
        deadline = time.monotonic() + 10.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._terminate()
        self.conn.close()

    # ------------------------------------------------------------------ helpers

    def _request(self, message: object, what: str) -> Reply:
        """Sends ``message`` to rank 0 and returns its reply; one request at a time, from any
        thread."""
        with self._channel:
            try:
                self.conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError as exc:
                self._die(f"rank 0's pipe is closed: {exc}")
            return self._wait(self.timeout_s, what)

    def _wait(self, timeout: float | None, what: str) -> Reply:
        """Rank 0's next reply; EngineDeadError when a local rank exits first or none comes
        within ``timeout`` seconds."""
        ready = multiprocessing.connection.wait([self.conn] + [p.sentinel for p in self.procs], timeout)
        for proc in self.procs:
            if proc.sentinel in ready:
                proc.join(1.0)  # a closed sentinel: reap it to learn its exit code
        dead = [p for p in self.procs if p.exitcode is not None]
        if self.conn in ready:
            try:
                return pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):  # rank 0 is going: say which rank went first
                multiprocessing.connection.wait([p.sentinel for p in self.procs], 2.0)
                dead = [p for p in self.procs if p.exitcode is not None]
        if dead:
            names = ", ".join(f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
            said = self._last_words()
            self._die(f"a worker process died during {what}: {names}" + (f" ({said})" if said else ""))
        if not ready:
            self._die(f"the workers did not finish {what} within engine.worker_timeout_s = "
                      f"{timeout:g} s (a hung rank or a collective that never completes)")
        self._die(f"rank 0 closed its pipe during {what}")
        raise AssertionError("unreachable")

    def _last_words(self) -> str | None:
        """Rank 0's failure message, if one comes within FATAL_EXIT_GRACE_S after another rank
        died: ranks that fail the same way (a weight no rank can split) exit at slightly
        different times, and the first exit seen should not hide the reason."""
        try:
            if not self.conn.poll(FATAL_EXIT_GRACE_S):
                return None
            reply = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError, pickle.UnpicklingError):
            return None
        return reply.message if isinstance(reply, (StartFailed, Fatal)) else None  # "rank 0: ..."

    def _fatal(self, message: str, what: str) -> None:
        """Rank 0 reported a failed collective. When a local rank died, that is the cause (the
        collective fails on the survivors the moment the peer's socket closes, often before its
        exit is seen): wait briefly for the exits and name the dead ranks first."""
        multiprocessing.connection.wait([p.sentinel for p in self.procs], FATAL_EXIT_GRACE_S)
        for proc in self.procs:
            if not proc.is_alive():
                proc.join(1.0)
        dead = [p for p in self.procs if p.exitcode is not None]
        if dead:
            names = ", ".join(f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
            message = f"a worker process died during {what}: {names} ({message})"
        self._die(message)

    def _die(self, message: str) -> None:
        from tandem.errors import EngineDeadError

        logger.error("mp executor: %s; stopping the workers", message)
        self._closed = True
        self._terminate()
        raise EngineDeadError(message)

    def _terminate(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)

