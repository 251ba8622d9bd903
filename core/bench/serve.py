"""`tandem bench serve`: the serving benchmark, through the HTTP API with streaming.

Requests are sent at a Poisson rate (``--request-rate``, default: all at once) and/or under a
concurrency cap (``--max-concurrency``), each a streamed /v1/completions with ``ignore_eos`` and
``max_tokens`` = its output length, so every request generates exactly what it asked for. The
requests are either random token ids — the same workload as ``tandem bench offline`` for the same
``--num-prompts/--prompt-len/--output-len/--seed`` — or read from a JSONL file whose lines are
``{"prompt": "text" or [ids], "output_len": N}`` or ``{"prompt_len": N, "output_len": M}``.

It reports request and token throughput and TTFT, TPOT, ITL and end-to-end latency (mean, p50,
p90, p99), goodput under ``--slo-ttft-ms``/``--slo-tpot-ms``, and with ``--plot FILE.png`` draws
their distributions. With ``--model PATH`` and no ``--url`` it starts its own server
(``python -m tandem serve PATH``, plus ``--server-args``) and stops it afterwards.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True, frozen=True)
class BenchRequest:
    prompt: str | list[int]
    output_len: int


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. ``itl_s`` holds the gaps between streamed chunks."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# ----------------------------------------------------------------------------- workload


def _vocabulary(model_path: str) -> tuple[int, set[int]]:
    """The model's vocabulary size and end-of-sequence ids (kept out of random prompts)."""
    from tandem.models.config import ModelArchConfig
    from tandem.models.loader import load_generation_config

    vocab = ModelArchConfig.from_pretrained_dir(model_path).vocab_size
    return vocab, load_generation_config(model_path)["eos_token_ids"]


def random_requests(model_path: str, num: int, prompt_len: tuple[int, int],
                    output_len: tuple[int, int], seed: int) -> list[BenchRequest]:
    """The workload of ``tandem bench offline`` with the same arguments."""
    from tandem.bench.workload import make_workload

    wl = make_workload(num, prompt_len, output_len, *_vocabulary(model_path), seed)
    return [BenchRequest(p, m) for p, m in zip(wl.prompts, wl.max_tokens)]


def file_requests(path: str, model_path: str, num: int | None, seed: int) -> list[BenchRequest]:
    """Requests from a JSONL file; a line with ``prompt_len`` gets random ordinary token ids."""
    vocab, eos = _vocabulary(model_path)
    ordinary = [t for t in range(vocab) if t not in eos]
    rng = random.Random(seed)
    requests = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        prompt = item.get("prompt")
        if prompt is None:
            prompt = [rng.choice(ordinary) for _ in range(int(item["prompt_len"]))]
        requests.append(BenchRequest(prompt, int(item["output_len"])))
    return requests[:num] if num else requests


# ----------------------------------------------------------------------------- the client


async def send_one(client: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestResult:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                if result.ttft_s == 0.0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
        result.e2e_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_benchmark(url: str, model: str, requests: list[BenchRequest], request_rate: float,
                        max_concurrency: int | None, seed: int) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at ``request_rate``/s, ``inf`` = all at once, at most
    ``max_concurrency`` in flight); returns the results in request order and the duration."""
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30.0)
    width = max_concurrency or len(requests) or 1
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=None)
    limit = asyncio.Semaphore(width)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def limited(request: BenchRequest) -> RequestResult:
            async with limit:
                return await send_one(client, model, request)

        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            if i and request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.ensure_future(limited(request)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# ----------------------------------------------------------------------------- the report


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = [r for r in ok
                if (slo_ttft_ms is None or r.ttft_s * 1000 <= slo_ttft_ms)
                and (slo_tpot_ms is None or (r.tpot_s or 0.0) * 1000 <= slo_tpot_ms)]
        summary["goodput"] = len(good) / duration_s
        summary["slo_ttft_ms"], summary["slo_tpot_ms"] = slo_ttft_ms, slo_tpot_ms
    return summary


def format_report(s: dict) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{s['completed']:>10}",
        f"{'Failed requests:':<40}{s['failed']:>10}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}",
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}",
    ]
    if "goodput" in s:
        lines.append(f"{'Goodput (req/s):':<40}{s['goodput']:>10.2f}"
                     f"   (TTFT <= {s['slo_ttft_ms']} ms, TPOT <= {s['slo_tpot_ms']} ms)")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st)"),
                       ("itl_ms", "Inter-token Latency"), ("e2e_ms", "End-to-end Latency")):
        lines.append(f"{('-' * 4) + ' ' + title + ' ' + ('-' * 4):-<50}")
        lines.extend(f"{name.capitalize() + ' (ms):':<40}{value:>10.2f}" for name, value in s[key].items())
    for error in s["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 50)
    return "\n".join(lines)


def plot(results: list[RequestResult], path: str) -> None:
    """Histograms of TTFT, TPOT, ITL and end-to-end latency, with p50/p90/p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    series = [("TTFT", [r.ttft_s for r in ok]), ("TPOT", [r.tpot_s for r in ok if r.tpot_s is not None]),
              ("ITL", [g for r in ok for g in r.itl_s]), ("End-to-end latency", [r.e2e_s for r in ok])]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (title, values) in zip(axes.flat, series):
        ms = np.asarray(values) * 1000.0
        ax.set_title(title)
        ax.set_xlabel("ms")
        if ms.size:
            ax.hist(ms, bins=40, color="tab:blue", alpha=0.8)
            for p, style in zip(PERCENTILES, (":", "--", "-")):
                ax.axvline(np.percentile(ms, p), color="tab:red", linestyle=style, label=f"p{p}")
            ax.legend()
    fig.suptitle(f"tandem serving latency ({len(ok)} requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- its own server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, server_args: list[str],
                 timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "tandem", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), *server_args]
    return start_process(cmd, port, timeout_s, stdout=subprocess.DEVNULL)


def start_process(cmd: list[str], port: int, timeout_s: float,
                  stdout: Any = None, **popen: Any) -> tuple[subprocess.Popen, str]:
    """Starts the server ``cmd`` (``popen``: more arguments of ``subprocess.Popen``) listening
    on 127.0.0.1:``port``; returns once its /health answers 200. A server that exits (RuntimeError,
    with the end of its stderr where ``popen`` pipes it) or is not ready within ``timeout_s``
    raises."""
    proc = subprocess.Popen(cmd, stdout=stdout, **popen)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr = proc.stderr.read() if proc.stderr is not None else ""
            if isinstance(stderr, bytes):
                stderr = stderr.decode(errors="replace")
            raise RuntimeError(f"the server exited with status {proc.returncode}: {shlex.join(cmd)}"
                               + (f"\n{stderr[-4000:]}" if stderr else ""))
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"the server did not become ready within {timeout_s:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running server (default: start one for --model)")
    p.add_argument("--model", help="model folder, .gguf file, preset or registry model name (as `tandem "
                                   "bench offline --model`): the server's (when starting one) and the "
                                   "workload's vocabulary (default with --url: /v1/models' root); "
                                   "vLLM gets a .gguf dequantized to float32 (built once)")
    p.add_argument("--served-model-name", help="the model name to send (default: /v1/models' first)")
    p.add_argument("--server-args", default="", help="extra `tandem serve` flags for its own server")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="number of requests (default: 32 random ones, or every line of --dataset)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(128, 128), metavar=("MIN", "MAX"))
    p.add_argument("--dataset", metavar="FILE.jsonl", help="requests from a JSONL file instead")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default: inf, all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--client", choices=("tandem", "vllm"), default="tandem",
                   help="the load generator: tandem's own (default) or vLLM's `vllm bench serve` "
                        "(random dataset, from the venv of --vllm-python), against either server")
    p.add_argument("--plot", metavar="FILE.png", help="draw the latency distributions")
    p.add_argument("--result-json", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="dtype of the servers it starts (default: tandem's auto; float32 for both "
                        "with --baseline)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="with --baseline: N rounds of tandem's server then the peer's, each started "
                        "afresh; every round's ratios are printed and their medians count")


Client = Callable[[argparse.Namespace, str, str, str], "dict | None"]
"""Another load generator: ``client(args, url, model_name, model_path)`` runs the benchmark
against ``url`` and returns the summary in ``summarize``'s shape (None when it failed)."""


class Peer(Protocol):
    """Another engine's server and load generator (a module of tandem.bench.peers, which adds its
    own arguments, ``--baseline`` among them, and which tandem.bench.cli hands to ``run``)."""

    def run_side_by_side(self, args: argparse.Namespace) -> int:
        """Both servers benchmarked one after the other (``--baseline``); the exit status."""

    def client(self, args: argparse.Namespace) -> Client | None:
        """The load generator ``--client`` names, None for tandem's own."""


def run(args: argparse.Namespace, peer: Peer | None = None) -> int:
    """The benchmark; with ``peer`` (given) and ``--baseline``, the peer's server too."""
    if args.url is None and args.model is None:
        print("tandem bench serve: give --url of a running server or --model to start one", file=sys.stderr)
        return 2
    if args.model is not None:
        from tandem.bench.checkpoint import model_path

        args.model = model_path(args.model)
    if peer is not None and args.baseline is not None:
        return peer.run_side_by_side(args)
    client = peer.client(args) if peer is not None else None
    if client is None and args.client != "tandem":
        print(f"tandem bench serve: --client {args.client} is a peer's (tandem.bench.peers): run it "
              "through the tandem command", file=sys.stderr)
        return 2
    if args.dtype:
        args.server_args += f" --dtype {args.dtype}"
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.model, shlex.split(args.server_args))
    try:
        summary = bench(args, url.rstrip("/"), client)
    finally:
        if proc is not None:
            stop_server(proc)
    return 0 if summary and summary["completed"] else 1


def workload_requests(args: argparse.Namespace, model_path: str) -> list[BenchRequest]:
    """The requests ``args`` ask for: ``--dataset``'s lines or random token ids."""
    if args.dataset:
        return file_requests(args.dataset, model_path, args.num_prompts, args.seed)
    return random_requests(model_path, args.num_prompts or 32, tuple(args.prompt_len),
                           tuple(args.output_len), args.seed)


def model_card(url: str) -> dict:
    """The first model the server at ``url`` lists in /v1/models."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]


def bench(args: argparse.Namespace, url: str, client: Client | None = None) -> dict | None:
    """The benchmark against ``url``, from tandem's own client or ``client``: prints the report,
    returns the summary (None when the warm-up request failed)."""
    card = model_card(url)
    model_name = args.served_model_name or card["id"]
    model_path = args.model or card["root"]
    requests = workload_requests(args, model_path)
    warmup = asyncio.run(run_benchmark(url, model_name, [BenchRequest(requests[0].prompt, 2)],
                                       float("inf"), 1, args.seed))[0][0]
    if not warmup.ok:
        print(f"tandem bench serve: the warm-up request failed: {warmup.error}", file=sys.stderr)
        return None
    print(f"{len(requests)} requests to {url} ({model_name}), rate {args.request_rate}/s, "
          f"max concurrency {args.max_concurrency or 'unlimited'}, client {args.client}", flush=True)
    if client is not None:
        summary = client(args, url, model_name, model_path)
        if summary is not None:
            print(format_report(summary))
        return summary
    results, duration = asyncio.run(run_benchmark(url, model_name, requests, args.request_rate,
                                                  args.max_concurrency, args.seed))
    summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    summary.update(num_prompts=len(requests), request_rate=args.request_rate,
                   max_concurrency=args.max_concurrency, model=model_name)
    print(format_report(summary))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(
            {**summary, "requests": [asdict(r) for r in results]}, indent=1))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return summary
