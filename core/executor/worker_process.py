"""One rank's process under the "mp" executor: torch.distributed set-up, the ``Worker``, and the
step loop.

Which process runs what (tp × pp ranks, ``rank = pp_rank * tp + tp_rank``)::

    engine process (head)        scheduler, detokenizer, API; MultiprocExecutor
       │  pipe: one pickled SchedulerOutput per step  ▼   ▲  one reply per step
    rank 0 (head)                Worker; relays each step to the other ranks and gathers replies
       │  gloo "cpu group", rank 0 ↔ each rank: the sealed step bytes; each rank's sealed reply
    ranks 1 .. world-1           Worker; on the head or on other hosts (``tandem serve --headless``)

Before the process group is made, every rank proves it holds the launch's cluster key and rank
0 proves it back (tandem.executor.rank_auth, over the rendezvous store); the step bytes and the
replies then travel sealed under the session key (tandem.executor.sealed_channel), and a first
sealed round checks every rank's connection to rank 0 before any step is sent.

Each step crosses the pipe once each way: the scheduler's diff (new requests in full, running
ones as ids, new blocks and new tokens) and the driver's ``ModelRunnerOutput`` (sampled tokens
and logprobs). Tensors — all-reduces, logits gathers, stage-to-stage hidden states — travel on
the world group (gloo on the CPU, NCCL on CUDA), whose collectives time out after
``engine.worker_timeout_s``; the cpu group waits without limit (an idle instance sends nothing).

A reply is one of tandem.executor.messages: ``StepDone``, ``StepFailed`` when every rank failed
the step in its Python code (the engine isolates it as in one process), or ``Fatal`` when a
collective failed or one rank failed alone (the ranks are out of step: the engine dies).

The process is ``python -m tandem.executor`` (tandem.executor.ranks starts it), never a re-import
of the user's main module; its ``WorkerSpec`` comes pickled on stdin, rank 0's pipe as an
inherited socket.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from tandem.config import TandemConfig
from tandem.executor.messages import (STOP, Fatal, KVCall, KVDone, Ready, Reply, StartFailed, StepDone,
                                      StepFailed)

logger = logging.getLogger("tandem")

IDLE_TIMEOUT = timedelta(days=3650)
HELLO = b"tandem-ranks/hello"


@dataclass(slots=True)
class WorkerSpec:
    """What a rank's process is started with."""

    config: TandemConfig
    eos_token_ids: frozenset[int]
    rank: int
    local_rank: int
    local_world_size: int
    cluster_key: bytes = field(repr=False)
    """What the ranks prove themselves with (tandem.executor.rank_auth.cluster_key)."""
    log_level: int = logging.INFO

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size


def init_distributed(spec: WorkerSpec) -> tuple[Any, Any]:
    """Join the rendezvous at ``parallel.master_addr:master_port``, prove the cluster key, build
    the groups and check the sealed channel; returns this rank's ``ParallelContext`` and its
    ``SealedChannel``. Raises ClusterAuthError when a rank or the head lacks the key, and
    RuntimeError naming the hosts that did not join."""
    import torch.distributed as dist

    from tandem.executor.netif import choose_gloo_interface
    from tandem.distributed import ParallelContext
    from tandem.executor.rank_auth import ClusterAuthError, admit_ranks, is_loopback, prove_rank
    from tandem.executor.rendezvous import open_store
    from tandem.executor.sealed_channel import SealedChannel

    par, eng = spec.config.parallel, spec.config.engine
    cuda = spec.config.engine.device.startswith("cuda") or (
        spec.config.engine.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(spec.local_rank)
    timeout = timedelta(seconds=eng.worker_timeout_s)
    # on one host over the loopback, gloo listens there too
    interface = choose_gloo_interface(par.master_addr) if par.nnodes > 1 or is_loopback(par.master_addr) else None
    where = f"{par.master_addr}:{par.master_port}"
    try:
        store = open_store(par.master_addr, par.master_port, spec.rank == 0, timeout)
        if spec.rank == 0:
            session = admit_ranks(store, spec.cluster_key, spec.world_size, eng.worker_timeout_s)
        else:
            session = prove_rank(store, spec.cluster_key, spec.rank, where, eng.worker_timeout_s)
        dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                timeout=timeout)
    except ClusterAuthError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds on a failed rendezvous
        raise RuntimeError(
            f"rank {spec.rank}: the {spec.world_size} ranks did not all join the rendezvous at "
            f"{where} within {eng.worker_timeout_s:g} s ({_rendezvous_hint(par, interface)}): {exc}") from exc
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    cpu_group = dist.new_group(list(range(spec.world_size)), backend="gloo", timeout=IDLE_TIMEOUT)
    tp_group = None
    for stage in range(pp):  # every rank builds every group, in the same order
        group = dist.new_group([stage * tp + i for i in range(tp)], timeout=timeout)
        if stage == spec.rank // tp:
            tp_group = group
    channel = SealedChannel(session, spec.rank, spec.world_size, cpu_group)
    hello = channel.broadcast(HELLO)  # checks each rank's connection to rank 0, both ways
    replies = channel.gather(hello)
    if hello != HELLO or (replies is not None and set(replies) != {HELLO}):
        raise ClusterAuthError(f"rank {spec.rank}: the first sealed round carried another message")
    context = ParallelContext(tp_size=tp, tp_rank=spec.rank % tp, pp_size=pp, pp_rank=spec.rank // tp,
                              tp_group=tp_group, pp_group=dist.group.WORLD, cpu_group=cpu_group)
    return context, channel


def _rendezvous_hint(par: Any, interface: str | None) -> str:
    """What the user of this host should check when the rendezvous failed."""
    if par.node_rank == 0:
        hint = (f"parallel.nnodes = {par.nnodes}: is `tandem serve --headless --node-rank N` running on "
                "every other host, with the same --master-addr and --master-port?")
    else:
        hint = ("is the head (`tandem serve --node-rank 0`, the same --nnodes) running at "
                f"{par.master_addr}, with the same --master-port?")
    if par.nnodes == 1:
        return hint
    chosen = f"it is {interface}" if interface else "none was found, so gloo chose from the hostname"
    return (f"{hint} gloo binds to the network interface GLOO_SOCKET_IFNAME names ({chosen}): it must "
            "be one the other hosts reach")


def _configure(spec: WorkerSpec) -> None:
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {spec.rank}]: %(message)s")
    logging.getLogger("tandem").setLevel(spec.log_level)
    eng = spec.config.engine
    if eng.num_threads is None and not torch.cuda.is_available():
        # ranks of one host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_world_size))
    if eng.device in ("auto", "cuda") and torch.cuda.is_available():
        eng.device = f"cuda:{spec.local_rank}"


def main(argv: list[str]) -> int:
    """``python -m tandem.executor --rank R [--conn-fd FD]``: read the parent's ``sys.path`` and
    this rank's ``WorkerSpec`` (pickled, in that order) from stdin, then run the rank; rank 0
    talks to the engine over the inherited socket ``FD``."""
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(prog="python -m tandem.executor",
                                     description="one rank of the mp executor (started by tandem)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--conn-fd", type=int)
    args = parser.parse_args(argv)
    sys.path[:] = pickle.load(sys.stdin.buffer)
    spec = pickle.load(sys.stdin.buffer)
    assert spec.rank == args.rank, f"rank {args.rank} was sent the spec of rank {spec.rank}"
    run_worker(spec, None if args.conn_fd is None else Connection(args.conn_fd))
    return 0


def run_worker(spec: WorkerSpec, conn: Any = None) -> None:
    """A rank's process: build the worker, then run steps until told to stop. Rank 0 talks to
    the engine over ``conn``; the others get their steps from rank 0. Exits 1 on a failure that
    leaves the ranks out of step."""
    _configure(spec)
    from tandem.distributed import set_current
    from tandem.worker.worker import Worker

    try:
        context, channel = init_distributed(spec)
        set_current(context)
        worker = Worker(spec.config, spec.eos_token_ids)
    except BaseException as exc:  # noqa: BLE001 - reported to the engine, then the process ends
        logger.error("start-up failed: %s: %s", type(exc).__name__, exc)
        if conn is not None:
            conn.send_bytes(pickle.dumps(StartFailed(f"rank {spec.rank}: {type(exc).__name__}: {exc}")))
        sys.exit(1)
    logger.info("rank %d of %d ready (tp rank %d, pp stage %d)", spec.rank, spec.world_size,
                context.tp_rank, context.pp_rank)
    if conn is not None:
        conn.send_bytes(pickle.dumps(Ready(worker.info)))
    try:
        _loop(worker, context, channel, conn)
    except Exception as exc:  # noqa: BLE001 - the ranks are out of step: end this process
        logger.error("the step loop failed: %s: %s", type(exc).__name__, exc)
        if conn is not None:
            try:
                conn.send_bytes(pickle.dumps(Fatal(f"rank 0: {type(exc).__name__}: {exc}")))
            except OSError:
                pass
        sys.exit(1)
    finally:
        worker.close()


def _loop(worker: Any, context: Any, channel: Any, conn: Any) -> None:
    rank, world = context.rank, context.world_size
    while True:
        if conn is not None:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):  # the engine is gone
                message = STOP
            if world > 1:
                channel.broadcast(message)
        else:
            message = channel.broadcast(None)
        if message == STOP:
            return
        reply = _run_step(worker, message)
        if world > 1:
            replies = channel.gather(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
            if rank != 0:
                if isinstance(reply, Fatal):
                    raise RuntimeError(reply.message)
                continue
            reply = _combine([pickle.loads(r) for r in replies], context.driver_rank)
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        if isinstance(reply, Fatal):
            raise RuntimeError(reply.message)


def _run_step(worker: Any, message: bytes) -> Reply:
    t0 = time.perf_counter()
    try:
        task = pickle.loads(message)
        if isinstance(task, KVCall):
            return KVDone([_kv_call(worker, task)])
        output = worker.execute(task)
    except Exception as exc:  # noqa: BLE001 - sorted out by _combine / the engine
        if _is_collective_error(exc):
            return Fatal(f"rank {worker.parallel.rank}: a collective failed: {type(exc).__name__}: {exc}")
        logger.error("step failed: %s", traceback.format_exc())
        return StepFailed(_picklable(exc))
    return StepDone(output if worker.parallel.is_driver else None, time.perf_counter() - t0)


def _kv_call(worker: Any, call: KVCall) -> Any:
    args = call.args[worker.parallel.rank]
    if call.method == "ping":  # the broadcast and gather around it are the check
        return None
    if call.method == "connect":
        return worker.connect_kv(*args).handshake_info()
    if worker.connector is None:
        raise RuntimeError("no KV connector: the instance is neither a prefill nor a decode instance")
    return getattr(worker.connector, call.method)(*args)


def _combine(replies: list[Reply], driver: int) -> Reply:
    """One reply for the engine: fatal if any rank's was, the exception if every rank failed,
    fatal if only some did, else the driver's output with the slowest rank's compute time.
    A connector call (no collective ran: the ranks are still in step) returns every rank's
    result, or the first rank's exception."""
    fatal = [r.message for r in replies if isinstance(r, Fatal)]
    if fatal:
        return Fatal("; ".join(fatal))
    failed = [i for i, r in enumerate(replies) if isinstance(r, StepFailed)]
    if any(isinstance(r, KVDone) for r in replies):
        return replies[failed[0]] if failed else KVDone([x for r in replies for x in r.results])
    if failed and len(failed) < len(replies):
        first = replies[failed[0]].error
        return Fatal(f"ranks {failed} failed a step the others ran ({type(first).__name__}: {first}); "
                     "the ranks are out of step")
    if failed:
        return replies[driver] if isinstance(replies[driver], StepFailed) else replies[failed[0]]
    return StepDone(replies[driver].output, max(r.worker_seconds for r in replies))


def _is_collective_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in ("gloo", "nccl", "connection closed", "connection reset", "timed out"))


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any exception type may refuse pickling
        return RuntimeError(f"{type(exc).__name__}: {exc}")
