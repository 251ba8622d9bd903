"""Starting a host's rank processes: each is ``python -m tandem.executor --rank R``, a fresh
interpreter whose main module is tandem's (tandem.executor.worker_process), so the user's own
main module — a script without an ``if __name__ == "__main__":`` guard, ``python -`` reading
stdin, ``python -c``, a notebook — is never imported again in a rank.

What a rank is started with travels on stdin (the parent's ``sys.path``, then the pickled
``WorkerSpec``, cluster key included), never in argv or the environment; rank 0 inherits one
end of a socket pair, the engine's pipe to it. The parent watches each process through a pidfd
(``RankProcess.sentinel``), which ``multiprocessing.connection.wait`` waits on like a pipe.
"""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import socket
import subprocess
import sys
import weakref

from tandem.config import TandemConfig
from tandem.executor.worker_process import WorkerSpec

logger = logging.getLogger("tandem")


class RankProcess:
    """One rank's process, with the part of ``multiprocessing.Process``'s interface the
    executor uses (``name``, ``pid``, ``sentinel``, ``exitcode``, ``is_alive``, ``join``,
    ``terminate``, ``kill``). Terminated when it is collected or the interpreter exits while it
    still runs, as a daemon process is."""

    def __init__(self, spec: WorkerSpec, conn_fd: int | None = None) -> None:
        self.name = f"tandem-rank-{spec.rank}"
        argv = [sys.executable, "-m", "tandem.executor", "--rank", str(spec.rank)]
        if conn_fd is not None:
            argv += ["--conn-fd", str(conn_fd)]
        self._popen = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                       pass_fds=() if conn_fd is None else (conn_fd,))
        self.pid = self._popen.pid
        self.sentinel = os.pidfd_open(self.pid)
        """Readable once the process has exited."""
        weakref.finalize(self, _stop, self._popen, self.sentinel)
        try:
            pickle.dump(sys.path, self._popen.stdin)
            pickle.dump(spec, self._popen.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self._popen.stdin.close()
        except BrokenPipeError:  # it died first: its exit code tells the executor
            pass

    @property
    def exitcode(self) -> int | None:
        """None while it runs; the exit code, or minus the signal that ended it."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


def _stop(popen: subprocess.Popen, pidfd: int) -> None:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(2.0)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    os.close(pidfd)


def start_ranks(config: TandemConfig, eos_token_ids: frozenset[int], first_rank: int, key: bytes,
                with_pipe: bool) -> tuple[list[RankProcess], multiprocessing.connection.Connection | None]:
    """Start ranks ``first_rank .. first_rank + world_size / nnodes - 1`` of this host; with
    ``with_pipe``, the first of them gets the other end of the returned connection."""
    par = config.parallel
    local = par.world_size // par.nnodes
    level = logging.getLogger("tandem").getEffectiveLevel()
    ours, theirs = socket.socketpair() if with_pipe else (None, None)
    procs = []
    try:
        for i in range(local):
            spec = WorkerSpec(config, eos_token_ids, first_rank + i, i, local, key, level)
            procs.append(RankProcess(spec, theirs.fileno() if theirs is not None and i == 0 else None))
    finally:
        if theirs is not None:
            theirs.close()
    conn = None if ours is None else multiprocessing.connection.Connection(ours.detach())
    return procs, conn


def run_headless(config: TandemConfig, eos_token_ids: frozenset[int]) -> int:
    """``tandem serve --headless``: run this host's ranks (``parallel.node_rank``) until the
    head stops them; returns the exit code (1 when a rank failed)."""
    from tandem.executor.rank_auth import cluster_key

    par = config.parallel
    if par.node_rank == 0:
        raise ValueError("--headless runs the ranks of another host: give it --node-rank 1 or above "
                         "(node 0, the head, runs `tandem serve` itself)")
    key = cluster_key(config)
    local = par.world_size // par.nnodes
    procs, _ = start_ranks(config, eos_token_ids, par.node_rank * local, key, with_pipe=False)
    logger.info("headless node %d: ranks %d..%d started, waiting for the head at %s:%d", par.node_rank,
                par.node_rank * local, par.node_rank * local + local - 1, par.master_addr, par.master_port)
    code = 0
    pending = list(procs)
    while pending:
        multiprocessing.connection.wait([p.sentinel for p in pending])
        for proc in [p for p in pending if p.exitcode is not None]:
            pending.remove(proc)
            if proc.exitcode != 0:
                logger.error("%s exited with code %s", proc.name, proc.exitcode)
                code = 1
                for other in pending:
                    other.terminate()
    return code
