"""vLLM as a baseline of ``tandem bench serve``, measured in the same run (``--baseline vllm``).

Both servers are started here, one after the other on a free port of 127.0.0.1 (they share the
cores, so never at once), on the same ``--model`` and dtype, with tandem's default batch limits
(64 sequences, 2,048 tokens per step) given to vLLM too; vLLM is ``vllm serve`` through
``vllm_cli.py`` run by ``--vllm-python``. Each gets an untimed warm-up round (the workload's
prompts reversed, two tokens each: vLLM compiles on the first batches of new shapes), then the
same requests from tandem's own client. It prints both reports and tandem's ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import time

from tandem.bench import serve
from tandem.bench.checkpoint import hf_folder
from tandem.bench.peers import peer_env, vllm_cli, vllm_client, vllm_offline, vllm_offline_driver
from tandem.config import ConfigError

VLLM_START_TIMEOUT_S = 1200.0  # start-up compiles with inductor: minutes on two busy cores
BATCH_LIMITS = ["--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]
RATIOS = (("output tok/s", "output_throughput", None), ("TTFT p50", "ttft_ms", "p50"),
          ("TPOT p50", "tpot_ms", "p50"), ("e2e p50", "e2e_ms", "p50"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--baseline`` and ``--vllm-python``, as ``tandem bench offline`` takes them."""
    vllm_offline.add_arguments(p)


def run_side_by_side(args: argparse.Namespace) -> int:
    if args.url is not None:
        raise ConfigError("--baseline starts both servers itself: give --model, not --url")
    if args.plot or args.result_json:
        raise ConfigError("--plot and --result-json write one server's figures: not with --baseline")
    vllm_offline.check_arguments(args)
    dtype = args.dtype or "float32"
    rounds = []
    for i in range(max(1, args.rounds)):
        print(f"=== round {i + 1} of {max(1, args.rounds)}", flush=True)
        pair = _one_round(args, dtype)
        if pair is None:
            return 1
        rounds.append(pair)
        print(format_ratios(*pair))
    if len(rounds) > 1:
        print(format_median_ratios(rounds))
    return 0


def _one_round(args: argparse.Namespace, dtype: str) -> tuple[dict, dict] | None:
    """tandem's server benchmarked, stopped, then vLLM's: their summaries (None if one failed)."""
    tandem_cmd = ["--dtype", dtype, *shlex.split(args.server_args)]
    print(f"=== tandem ({dtype})", flush=True)
    proc, url = serve.start_server(args.model, tandem_cmd)
    ours = _warm_and_bench(args, proc, url)
    if ours is None:
        return None
    port = serve.free_port()
    cmd = [args.vllm_python, vllm_cli.__file__, "serve", hf_folder(args.model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--seed", str(args.seed), *BATCH_LIMITS]
    print(f"=== vllm: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc, url = serve.start_process(cmd, port, VLLM_START_TIMEOUT_S, env=peer_env())
    print(f"vllm: ready in {time.perf_counter() - t0:.0f} s", flush=True)
    theirs = _warm_and_bench(args, proc, url)
    return None if theirs is None else (ours, theirs)


def client(args: argparse.Namespace) -> serve.Client | None:
    """vLLM's ``vllm bench serve`` with ``--client vllm``, else None (tandem's own client)."""
    return vllm_client.bench if args.client == "vllm" else None


def _warm_and_bench(args: argparse.Namespace, proc, url: str) -> dict | None:
    try:
        requests = serve.workload_requests(args, args.model)
        warm = [serve.BenchRequest(p, 2) for p in
                vllm_offline_driver.warmup_prompts([r.prompt for r in requests])]
        t0 = time.perf_counter()
        name = args.served_model_name or serve.model_card(url)["id"]
        asyncio.run(serve.run_benchmark(url, name, warm, float("inf"), args.max_concurrency,
                                        args.seed))
        print(f"warm-up round (untimed): {time.perf_counter() - t0:.1f} s", flush=True)
        return serve.bench(args, url, client(args))
    finally:
        serve.stop_server(proc)


def _figure(summary: dict, key: str, stat: str | None) -> float:
    return summary[key] if stat is None else summary[key][stat]


def format_ratios(ours: dict, theirs: dict) -> str:
    """tandem's figures over vLLM's: above 1 is better for throughput, below 1 for latencies."""
    lines = ["", "metric            tandem       vllm   tandem / vllm"]
    for name, key, stat in RATIOS:
        a, b = _figure(ours, key, stat), _figure(theirs, key, stat)
        lines.append(f"{name:<14} {a:9.2f}  {b:9.2f}   {a / b:10.2f}x")
    return "\n".join(lines)


def format_median_ratios(rounds: list[tuple[dict, dict]]) -> str:
    """Per metric, the median over the rounds of tandem's figure over vLLM's, and their range."""
    lines = ["", f"metric          median tandem / vllm over {len(rounds)} rounds (range)"]
    for name, key, stat in RATIOS:
        ratios = [_figure(a, key, stat) / _figure(b, key, stat) for a, b in rounds]
        lines.append(f"{name:<14} {statistics.median(ratios):8.2f}x   ({min(ratios):.2f}-{max(ratios):.2f}x)")
    return "\n".join(lines)
