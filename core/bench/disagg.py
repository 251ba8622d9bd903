"""`tandem bench disagg`: colocated vs disaggregated serving on the same cores, in one run.

It starts a colocated instance (``--colocated-threads`` torch threads, default 2), runs the
workload, stops it; then starts ``tandem serve --disaggregated`` (router + prefill + decode, each
instance ``--instance-threads`` torch threads, default 1), runs the same workload through the
router, stops it. The workload, on a clock that starts with the first request::

    steady streams   --streams concurrent loops, each sending one request of --stream-prompt-len
                     random tokens generating --stream-output-len tokens (ignore_eos) and sending
                     the next as soon as it ends, until --duration-s has passed
    bursts           every --burst-interval-s (first at t = interval), --burst-size requests of
                     --burst-prompt-len tokens generating --burst-output-len MIN..MAX tokens,
                     sent on schedule whether or not the previous burst has finished

Requests in flight at the deadline finish and count. Every prompt is fresh random token ids (no
prefix-cache hits); both setups get the same prompts. TPOT is measured on the steady streams
(the decode latency that disaggregation protects), TTFT on both kinds. The report is a table of
TTFT and TPOT at p50 and p99 for both setups and the ratio colocated p99 TPOT / disaggregated p99
TPOT against the 1.5x target; ``--plot FILE.png`` draws the distributions.

The default burst interval (15 s) is sized for bench-100m on a 2-core CPU: a burst of four
1,500-token prompts takes one torch thread about 13 s to prefill, so a shorter interval overloads
the one-thread prefill instance and the long prompts' TTFT grows for as long as the run lasts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

from tandem.bench.serve import (
    BenchRequest,
    RequestResult,
    random_requests,
    send_one,
    start_server,
    stop_server,
    summarize,
)
from tandem.server.supervisor import free_port

TPOT_TARGET_RATIO = 1.5
PROMPT_CHUNK = 64
SETUPS = ("colocated", "disaggregated")


@dataclass(slots=True, frozen=True)
class Workload:
    duration_s: float
    streams: int
    stream_prompt_len: int
    stream_output_len: int
    burst_size: int
    burst_prompt_len: int
    burst_output_len: tuple[int, int]
    burst_interval_s: float
    seed: int


@dataclass(slots=True)
class SetupRun:
    """One setup's results as the client saw them."""

    steady: list[RequestResult]
    bursts: list[RequestResult]
    duration_s: float


class PromptSource:
    """Fresh random requests of one shape, drawn ``PROMPT_CHUNK`` at a time from a seeded
    sequence, so the same seed gives both setups the same requests in the same order."""

    def __init__(self, model_path: str, prompt_len: int, output_len: tuple[int, int], seed: int):
        self._args = (model_path, PROMPT_CHUNK, (prompt_len, prompt_len), output_len)
        self._seeds = random.Random(seed)
        self._queue: deque[BenchRequest] = deque()

    def next(self) -> BenchRequest:
        if not self._queue:
            self._queue.extend(random_requests(*self._args, seed=self._seeds.getrandbits(32)))
        return self._queue.popleft()


# ----------------------------------------------------------------------------- the workload


async def run_workload(url: str, model_name: str, model_path: str, wl: Workload) -> SetupRun:
    """Run ``wl`` against ``url``; returns when every request it sent has finished."""
    steady_source = PromptSource(model_path, wl.stream_prompt_len,
                                 (wl.stream_output_len, wl.stream_output_len), wl.seed)
    burst_source = PromptSource(model_path, wl.burst_prompt_len, wl.burst_output_len, wl.seed + 1)
    steady: list[RequestResult] = []
    bursts: list[RequestResult] = []
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        deadline = start + wl.duration_s

        async def stream() -> None:
            while time.perf_counter() < deadline:
                result = await send_one(client, model_name, steady_source.next())
                steady.append(result)
                if not result.ok:
                    return

        async def burst_schedule() -> None:
            in_flight = []
            k = 1
            while (due := start + k * wl.burst_interval_s) < deadline:
                await asyncio.sleep(max(due - time.perf_counter(), 0.0))
                in_flight += [asyncio.ensure_future(send_one(client, model_name, burst_source.next()))
                              for _ in range(wl.burst_size)]
                k += 1
            bursts.extend(await asyncio.gather(*in_flight))

        await asyncio.gather(*(stream() for _ in range(wl.streams)), burst_schedule())
        return SetupRun(steady, bursts, time.perf_counter() - start)


async def warm_up(url: str, model_name: str, model_path: str, wl: Workload) -> RequestResult | None:
    """One short and one long request (prompts the workload never sends); the first failure,
    or None."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=30.0)) as client:
        for offset, prompt_len in ((2, wl.stream_prompt_len), (3, wl.burst_prompt_len)):
            request = PromptSource(model_path, prompt_len, (2, 2), wl.seed + offset).next()
            result = await send_one(client, model_name, request)
            if not result.ok:
                return result
    return None


# ----------------------------------------------------------------------------- the setups


def _threads_config(folder: Path, name: str, threads: int) -> str:
    path = folder / f"{name}.toml"
    path.write_text(f"[engine]\nnum_threads = {threads}\n")
    return str(path)


def start_disaggregated(model: str, server_args: list[str],
                        timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``tandem serve --disaggregated``; returns once the router reports every instance healthy
    (its /health lists them to the admin: the keys are given to it by the environment)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--disaggregated", model,
           "--host", "127.0.0.1", "--port", str(port), *server_args]
    admin_key = secrets.token_urlsafe(32)
    keys = {"TANDEM_DISAGGREGATION__ROUTER_ADMIN_KEY": admin_key,
            "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": secrets.token_urlsafe(32)}  # none made, none written
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, **keys})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the disaggregated setup exited with status {proc.returncode}: "
                               f"{shlex.join(cmd)}")
        try:
            health = httpx.get(f"{url}/health", timeout=5, headers={"Authorization": f"Bearer {admin_key}"})
            instances = health.json().get("instances", [])
            if health.status_code == 200 and instances and all(i["healthy"] for i in instances):
                return proc, url
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"the disaggregated setup did not become ready within {timeout_s:.0f} s")


def router_paths(url: str) -> dict[str, int]:
    """How the router dispatched its requests: ``{path: count}`` from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "tandem:router_requests_total":
                counts[sample.labels["path"]] = int(sample.value)
    return counts


def run_setup(name: str, args: argparse.Namespace, wl: Workload, folder: Path) -> dict:
    """Start setup ``name``, warm it up, run the workload, stop it; its summary."""
    extra = shlex.split(args.server_args)
    if name == "colocated":
        threads = args.colocated_threads
        proc, url = start_server(args.model, ["--config", _threads_config(folder, name, threads), *extra])
    else:
        threads = args.instance_threads
        proc, url = start_disaggregated(args.model,
                                        ["--config", _threads_config(folder, name, threads), *extra])
    try:
        model_name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        failed = asyncio.run(warm_up(url, model_name, args.model, wl))
        if failed is not None:
            raise RuntimeError(f"the {name} warm-up request failed: {failed.error}")
        print(f"{name}: {threads} torch thread(s) per instance, running the workload for "
              f"{wl.duration_s:.0f} s", flush=True)
        result = asyncio.run(run_workload(url, model_name, args.model, wl))
        summary = summarize_setup(result)
        summary["torch_threads"] = threads
        if name == "disaggregated":
            summary["router_paths"] = router_paths(url)
        return summary
    finally:
        stop_server(proc)


# ----------------------------------------------------------------------------- the report


def summarize_setup(result: SetupRun) -> dict:
    """serve.py's summaries of the steady streams, the bursts and all requests together."""
    everything = result.steady + result.bursts
    return {"steady": summarize(result.steady, result.duration_s),
            "bursts": summarize(result.bursts, result.duration_s),
            "all": summarize(everything, result.duration_s),
            "duration_s": result.duration_s,
            "requests": {"steady": [asdict(r) for r in result.steady],
                         "bursts": [asdict(r) for r in result.bursts]}}


def tpot_ratio(report: dict) -> float:
    """Colocated p99 TPOT / disaggregated p99 TPOT, on the steady streams."""
    return (report["colocated"]["steady"]["tpot_ms"]["p99"]
            / report["disaggregated"]["steady"]["tpot_ms"]["p99"])


_ROWS = (("TTFT, all requests", "all", "ttft_ms"), ("TTFT, steady streams", "steady", "ttft_ms"),
         ("TTFT, long prompts", "bursts", "ttft_ms"), ("TPOT, steady streams", "steady", "tpot_ms"),
         ("ITL, steady streams", "steady", "itl_ms"))


def format_table(report: dict) -> str:
    col, dis = report["colocated"], report["disaggregated"]
    head = (f"colocated ({col['torch_threads']} threads)",
            f"disaggregated ({dis['torch_threads']}+{dis['torch_threads']} threads)")
    lines = [f"{'':<24}{head[0]:>24}{head[1]:>32}",
             f"{'(ms)':<24}{'p50':>12}{'p99':>12}{'p50':>16}{'p99':>16}"]
    for title, group, metric in _ROWS:
        c, d = col[group][metric], dis[group][metric]
        lines.append(f"{title:<24}{c['p50']:>12.1f}{c['p99']:>12.1f}{d['p50']:>16.1f}{d['p99']:>16.1f}")
    for group, what in (("steady", "steady requests"), ("bursts", "long prompts")):
        lines.append(f"{what + ' ok/failed':<24}"
                     f"{col[group]['completed']:>12}{col[group]['failed']:>12}"
                     f"{dis[group]['completed']:>16}{dis[group]['failed']:>16}")
    ratio = report["tpot_p99_ratio"]
    verdict = "met" if ratio >= TPOT_TARGET_RATIO else "missed"
    lines.append(f"p99 TPOT colocated / disaggregated: {ratio:.2f}x "
                 f"(target >= {TPOT_TARGET_RATIO}x: {verdict})")
    if "router_paths" in dis:
        lines.append(f"router dispatch paths: {dis['router_paths']}")
    before, after = (", ".join(f"{x:.2f}" for x in report[k]) for k in ("loadavg_before", "loadavg_after"))
    lines.append(f"load average (1, 5, 15 min): before {before}; after {after}")
    for setup in SETUPS:
        for error in report[setup]["all"]["errors"]:
            lines.append(f"{setup} error: {error}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Empirical CDFs, both setups, p99 marked: the steady streams' TPOT (one value per request)
    and ITL (one per token: the decode stalls a request's mean hides), every request's TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    panels = (("TPOT, steady streams", "steady", "tpot"), ("ITL, steady streams", "steady", "itl"),
              ("TTFT, all requests", "all", "ttft"))
    for ax, (title, group, metric) in zip(axes, panels):
        for setup, color in zip(SETUPS, ("tab:red", "tab:blue")):
            ms = np.sort(_values_ms(report[setup]["requests"], group, metric))
            if ms.size:
                ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", color=color,
                        label=f"{setup} (p99 {np.percentile(ms, 99):.0f} ms)")
                ax.axvline(np.percentile(ms, 99), color=color, linestyle="--", linewidth=0.8)
        ax.set_title(title)
        ax.set_xscale("log")
        ax.set_xlabel("ms (log scale)")
        ax.set_ylabel("cumulative fraction")
        ax.legend()
    fig.suptitle(f"colocated vs disaggregated: p99 TPOT ratio {report['tpot_p99_ratio']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _values_ms(requests: dict, group: str, metric: str) -> list[float]:
    rows = requests["steady"] + requests["bursts"] if group == "all" else requests[group]
    results = [r for r in (RequestResult(**row) for row in rows) if r.ok]
    if metric == "itl":
        values = [gap for r in results for gap in r.itl_s]
    else:
        values = [r.tpot_s if metric == "tpot" else r.ttft_s for r in results]
    return [v * 1000.0 for v in values if v is not None]


# ----------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bench-100m preset, built on first use)")
    p.add_argument("--duration-s", type=float, default=60.0,
                   help="how long each setup runs the workload (default 60)")
    p.add_argument("--colocated-threads", type=int, default=2, help="torch threads of the colocated instance")
    p.add_argument("--instance-threads", type=int, default=1,
                   help="torch threads of each disaggregated instance (prefill, decode)")
    p.add_argument("--streams", type=int, default=8, help="concurrent steady decoding streams")
    p.add_argument("--stream-prompt-len", type=int, default=32)
    p.add_argument("--stream-output-len", type=int, default=256)
    p.add_argument("--burst-size", type=int, default=4, help="long prompts per burst")
    p.add_argument("--burst-prompt-len", type=int, default=1500)
    p.add_argument("--burst-output-len", type=int, nargs=2, default=(1, 8), metavar=("MIN", "MAX"))
    p.add_argument("--burst-interval-s", type=float, default=15.0, help="seconds between bursts")
    p.add_argument("--server-args", default="", help="extra `tandem serve` flags for both setups")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE.png", help="draw both setups' TPOT and TTFT distributions")
    p.add_argument("--result-json", metavar="FILE", help="write the report, every request included")


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        from tandem.models.presets import default_model_path

        args.model = str(default_model_path("bench-100m"))
    wl = Workload(args.duration_s, args.streams, args.stream_prompt_len, args.stream_output_len,
                  args.burst_size, args.burst_prompt_len, tuple(args.burst_output_len),
                  args.burst_interval_s, args.seed)
    report: dict = {"workload": asdict(wl), "model": args.model, "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="tandem-bench-disagg-") as folder:
        for setup in SETUPS:
            report[setup] = run_setup(setup, args, wl, Path(folder))
    report["loadavg_after"] = os.getloadavg()
    report["tpot_p99_ratio"] = tpot_ratio(report)
    print(format_table(report))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
        print(f"plot: {args.plot}")
    measured = [report[s][g]["completed"] for s in SETUPS for g in ("steady", "bursts")]
    return 0 if all(measured) and math.isfinite(report["tpot_p99_ratio"]) else 1
