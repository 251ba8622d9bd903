"""`tandem bench offline -tp N -pp M`: tandem on N × M ranks against tandem on one rank, in one run.

Both setups get the same requests (``tandem.bench.workload.make_workload``), the same KV pool in
blocks and the same cores: each rank of the parallel run (the "mp" executor) gets
``threads_per_rank`` torch threads (``--threads`` / ranks, default cpu_count / ranks, which is what
the mp executor picks), the run on one rank (the "uniproc" executor) all ``ranks ×
threads_per_rank`` of them. Each setup is warmed up, then timed ``--repeats`` times, the two
alternating; the median run counts.

Per step of the parallel run the executor records ``step_seconds`` (the round trip the engine
sees) and ``worker_seconds`` (the slowest rank's compute, the collectives inside the model
included); the difference is the channel: the pipe to rank 0, the gloo broadcast of the step and
the gather of the replies. The tensor-parallel collectives inside the step are timed apart, after
the runs: ``tp`` fresh processes with the same threads run gloo's all-reduce of ``[tokens, hidden]`` and
gather of ``[rows, vocab / tp]`` logits at the median tokens and logit rows per step, and calls per
step × time per call estimates their share. The estimate leaves out waiting for a slower rank and
the run's own contention for the cores.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.bench.workload import ModeResult, Workload, agreement, describe_workload, run_tandem

COLLECTIVE_WARMUP, COLLECTIVE_ITERS = 5, 30


@dataclass(slots=True, frozen=True)
class Layout:
    """Where a setup runs: its tensor × pipeline ranks and each rank's torch threads."""

    tp: int
    pp: int
    threads_per_rank: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        return "1 rank" if self.world_size == 1 else f"tp={self.tp} pp={self.pp}"


@dataclass(slots=True, frozen=True)
class StepRecord:
    """One ``executor.execute``: its round trip, the slowest rank's compute (the round trip on
    one rank, which has no channel), its scheduled tokens and the rows it computed logits for."""

    seconds: float
    worker_seconds: float
    num_tokens: int
    num_logit_rows: int

    @property
    def channel_seconds(self) -> float:
        return self.seconds - self.worker_seconds


@dataclass(slots=True, frozen=True)
class StepSize:
    """The medians of the parallel run's steps that the collectives are timed at."""

    num_tokens: int
    num_logit_rows: int


@dataclass(slots=True)
class SetupResult:
    layout: Layout
    runs: list[ModeResult]
    steps: list[StepRecord]

    def tokens_per_s(self, wl: Workload) -> float:
        return statistics.median(r.tokens_per_s(wl) for r in self.runs)

    def median_step_ms(self) -> float:
        return 1e3 * statistics.median(s.seconds for s in self.steps)


@dataclass(slots=True, frozen=True)
class CollectiveTimes:
    """Median seconds per call of gloo collectives among ``tp`` processes (None: not measured,
    ``reason`` says why)."""

    all_reduce_s: float | None
    gather_s: float | None
    reason: str = ""


def run_comparison(args: argparse.Namespace, path: str, wl: Workload) -> int:
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    per_rank = max(1, (args.threads or os.cpu_count() or 1) // (tp * pp))
    single, parallel = Layout(1, 1, per_rank * tp * pp), Layout(tp, pp, per_rank)
    print(describe_workload(path, wl, args))
    print(f"tandem on {single.label} (uniproc, {single.threads_per_rank} torch threads) vs "
          f"{parallel.label} (mp, {parallel.world_size} ranks x {per_rank} torch threads), "
          f"{args.repeats} timed runs each, alternating", flush=True)
    llms = [_build(path, args, single)]
    try:
        llms.append(_build(path, args, parallel, num_kv_blocks=llms[0].engine.executor.num_kv_blocks))
        arch, dtype = llms[0].engine.arch, llms[0].engine.dtype
        results = _time_setups(llms, [single, parallel], wl, args.repeats)
    finally:
        for llm in llms:
            llm.engine.close()
    steps = results[1].steps
    typical = StepSize(statistics.median_low(s.num_tokens for s in steps),
                       statistics.median_low(s.num_logit_rows for s in steps))
    collectives = CollectiveTimes(None, None, "tp = 1: no all-reduce; the stage-to-stage sends are "
                                  "not timed apart")
    if tp > 1:
        collectives = measure_collectives(tp, per_rank, typical.num_tokens, arch.hidden_size,
                                          typical.num_logit_rows, -(-arch.vocab_size // tp),
                                          dtype)
    _print_report(results, wl, collectives, all_reduces_per_step(arch.num_hidden_layers, pp),
                  typical)
    return 0


def _time_setups(llms: list, layouts: list[Layout], wl: Workload, repeats: int) -> list[SetupResult]:
    """Warm every setup up, then run ``wl`` on each in turn, ``repeats`` times."""
    results = [SetupResult(layout, [], []) for layout in layouts]
    for llm in llms:
        _warm_up(llm, wl)
    for i in range(repeats):
        for llm, result in zip(llms, results):
            with _recording_steps(llm) as steps:
                run = run_tandem(llm, wl, cold=True)
            result.runs.append(run)
            result.steps.extend(steps)
            print(f"  run {i + 1}  {result.layout.label:<10} {run.seconds:7.2f} s  "
                  f"{run.tokens_per_s(wl):8.1f} tok/s", flush=True)
    return results


def all_reduces_per_step(num_layers: int, pp: int) -> int:
    """All-reduces one rank of the first stage (the busiest) runs per step: the embedding's,
    then attention's and the MLP's output projections in each of its layers."""
    return 1 + 2 * -(-num_layers // pp)


def _build(path: str, args: argparse.Namespace, layout: Layout, num_kv_blocks: int | None = None):
    from tandem import LLM

    overrides = {"num_kv_blocks": num_kv_blocks} if num_kv_blocks is not None else {}
    return LLM(model=path, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens,
               num_speculative_tokens=args.num_speculative_tokens, num_threads=layout.threads_per_rank,
               tensor_parallel_size=layout.tp, pipeline_parallel_size=layout.pp, **overrides)


def _warm_up(llm, wl: Workload) -> None:
    from tandem import SamplingParams

    llm.generate(wl.prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


@contextlib.contextmanager
def _recording_steps(llm) -> Iterator[list[StepRecord]]:
    """Record every ``executor.execute`` of ``llm`` while the block runs."""
    from tandem.executor.mp import MultiprocExecutor

    executor, steps = llm.engine.executor, []
    execute = executor.execute

    def recorded(sched_out):
        t0 = time.perf_counter()
        out = execute(sched_out)
        seconds = time.perf_counter() - t0
        if isinstance(executor, MultiprocExecutor):
            seconds, worker = executor.step_seconds, executor.worker_seconds
        else:
            worker = seconds
        steps.append(StepRecord(seconds, worker, sched_out.total_num_scheduled_tokens,
                                len(out.sampled_token_ids)))
        return out

    executor.execute = recorded
    try:
        yield steps
    finally:
        del executor.execute


# --------------------------------------------------------------------------- collectives


def measure_collectives(tp: int, threads: int, num_tokens: int, hidden_size: int, logit_rows: int,
                        vocab_rows: int, dtype) -> CollectiveTimes:
    """Time gloo's all-reduce of ``[num_tokens, hidden_size]`` (``dtype``) and gather of
    ``[logit_rows, vocab_rows]`` float32 on rank 0, in ``tp`` fresh processes of ``threads``
    torch threads each; median seconds per call."""
    import torch.multiprocessing as mp

    from tandem.executor.mp import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    shapes = ((num_tokens, hidden_size), (max(logit_rows, 1), vocab_rows))
    procs = [ctx.Process(target=_collective_rank, args=(rank, tp, port, threads, shapes, dtype, queue),
                         daemon=True) for rank in range(tp)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    if any(proc.exitcode != 0 for proc in procs):
        for proc in procs:
            proc.kill()
        codes = ", ".join(str(p.exitcode) for p in procs)
        return CollectiveTimes(None, None, f"the timing processes failed (exit codes {codes})")
    return queue.get()


def _collective_rank(rank: int, tp: int, port: int, threads: int, shapes, dtype, queue) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=timedelta(seconds=60))
    hidden = torch.randn(shapes[0]).to(dtype)
    logits = torch.randn(shapes[1])
    parts = [torch.empty_like(logits) for _ in range(tp)] if rank == 0 else None
    all_reduce_s = _median_call_s(lambda: dist.all_reduce(hidden))
    gather_s = _median_call_s(lambda: dist.gather(logits, parts, dst=0))
    if rank == 0:
        queue.put(CollectiveTimes(all_reduce_s, gather_s))
    dist.destroy_process_group()


def _median_call_s(call) -> float:
    import torch.distributed as dist

    seconds = []
    for _ in range(COLLECTIVE_WARMUP + COLLECTIVE_ITERS):
        dist.barrier()
        t0 = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[COLLECTIVE_WARMUP:])


# --------------------------------------------------------------------------- report


def _print_report(results: list[SetupResult], wl: Workload, collectives: CollectiveTimes,
                  num_all_reduces: int, typical: StepSize) -> None:
    single, parallel = results
    print("\nsetup        tok/s (median)   median step ms   steps per run")
    for r in results:
        print(f"{r.layout.label:<12} {r.tokens_per_s(wl):14.1f}   {r.median_step_ms():14.2f}   "
              f"{len(r.steps) // len(r.runs):13d}")
    steps = parallel.steps
    channel_ms = 1e3 * statistics.median(s.channel_seconds for s in steps)
    channel_share = statistics.median(s.channel_seconds / s.seconds for s in steps)
    worker_ms = 1e3 * statistics.median(s.worker_seconds for s in steps)
    step_ms = parallel.median_step_ms()
    ratio = parallel.tokens_per_s(wl) / single.tokens_per_s(wl)
    print(f"\n{parallel.layout.label} / 1 rank: {ratio:.2f}x tok/s")
    print(f"channel (step_seconds - worker_seconds), median over {len(steps)} steps: {channel_ms:.3f} ms "
          f"per step, {channel_share:.1%} of the step (median step {step_ms:.2f} ms, median slowest-rank "
          f"compute {worker_ms:.2f} ms)")
    print(_collectives_line(parallel.layout, collectives, num_all_reduces, typical, step_ms))
    print(f"greedy agreement of {parallel.layout.label} with 1 rank: "
          f"{agreement(single.runs[0].outputs, parallel.runs[0].outputs):.0%}")


def _collectives_line(layout: Layout, c: CollectiveTimes, num_all_reduces: int, step: StepSize,
                      step_ms: float) -> str:
    if c.all_reduce_s is None:
        return f"all-reduce inside the step: not measured ({c.reason})"
    per_step_ms = 1e3 * (num_all_reduces * c.all_reduce_s + c.gather_s)
    return (f"all-reduce inside the step (gloo, timed apart in {layout.tp} processes x "
            f"{layout.threads_per_rank} torch threads, at the median {step.num_tokens} tokens per step): "
            f"{1e6 * c.all_reduce_s:.0f} us per call x {num_all_reduces} calls + logits gather of "
            f"{step.num_logit_rows} rows (median) {1e6 * c.gather_s:.0f} us = {per_step_ms:.3f} ms per step, "
            f"{per_step_ms / step_ms:.1%} of the median step")
