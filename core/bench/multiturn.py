"""`tandem bench multiturn`: multi-turn conversations on one prefill and two decode instances in
three test hosts (network namespaces; KV over NIXL with UCX over TCP), in three setups one after
another, each on fresh processes, same conversations:

    reuse       every instance publishes KV events; the router routes decode steps with
                ``cache_aware`` and decodes in place below ``--min-uncached`` new tokens
    no_reuse    the same cluster with prefix caching off everywhere (every turn prefilled whole
                and its whole KV handed over), decode steps ``least_loaded``
    colocated   two colocated instances (the decode hosts) behind the router, ``round_robin``

The workload: ``--users`` users talk at once, each ``--turns`` turns, one after another. Every
conversation starts with the same system prompt (``--system-words`` words); each turn adds a user
message (``--user-words`` words) and the answer (``--output-len`` tokens, greedy, ignore_eos):
turn t's prompt is the whole conversation so far. Measured per setup: TTFT p50/p99 (streamed,
as the client sees it), output tokens/s (all output over the wall time of the run), KV bytes
the decode instances read (``tandem:kv_transfer_bytes_total``), the prompt tokens the answering
instance found cached (usage ``cached_tokens``) and the prefix the workload offers (each
prompt's share sent before, in characters: the shared system prompt on a first turn, the
conversation's previous prompt and its answer on later ones). The
report ends with the ratio no_reuse / reuse TTFT p50 against the 3x goal. Needs root (``ip
netns``) and nixl-cu12.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from tandem.bench.cluster_io import child_env, scrape, toml
from tandem.bench.netns import HOST_DEVICE, Host, HostsUnavailable, TestHosts
from tandem.bench.serve import free_port

SETUPS = ("reuse", "no_reuse", "colocated")
TTFT_GOAL = 3.0
PORT = 8000
EVENTS_PORT, REPLAY_PORT = 5557, 5558
MODEL_NAME = "bench"
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": HOST_DEVICE, "OMP_NUM_THREADS": "1"}
_SYLLABLES = ("ka", "lo", "mi", "ren", "to", "sa", "vel", "du", "pra", "ne", "gor", "li", "fe",
              "bo", "tan", "ri", "shu", "mo", "zel", "wi")


@dataclass(slots=True)
class Turn:
    """One request as the client saw it."""

    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    offered_chars: int = 0
    prompt_chars: int = 0
    error: str | None = None


@dataclass(slots=True)
class SetupResult:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    kv_bytes: float = 0.0
    paths: dict[str, float] = field(default_factory=dict)


def words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count))


# --------------------------------------------------------------------------- the cluster


def instance_config(setup: str, role: str, host: Host, args, secret: str) -> dict:
    engine = {"num_threads": args.instance_threads, "max_num_seqs": args.users,
              "enable_prefix_caching": setup != "no_reuse"}
    config = {"model": {"path": args.model, "served_model_name": MODEL_NAME}, "engine": engine,
              "server": {"host": host.address, "port": PORT},
              "disaggregation": {"role": role, "kv_connector": "nixl", "kv_transfer_secret": secret}}
    if setup == "reuse":
        config["kv_events"] = {"enabled": True, "endpoint": f"tcp://{host.address}:{EVENTS_PORT}",
                               "replay_endpoint": f"tcp://{host.address}:{REPLAY_PORT}"}
    return config


def router_config(setup: str, instances: list[tuple[str, str]], port: int, args, secret: str) -> dict:
    policies = {"reuse": ("round_robin", "cache_aware"), "no_reuse": ("round_robin", "least_loaded"),
                "colocated": ("round_robin", "round_robin")}[setup]
    disagg = {"instances": [{"url": u, "role": r} for u, r in instances], "kv_transfer_secret": secret,
              "routing_policy": policies[0], "decode_routing_policy": policies[1]}
    if setup == "reuse":
        disagg["min_uncached_prefill_tokens"] = args.min_uncached
    return {"server": {"host": "127.0.0.1", "port": port}, "disaggregation": disagg}


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not start:\n{log.read_text()[-2000:]}")


def start_setup(setup: str, net: TestHosts, args, folder: Path) -> tuple[str, list[str], list[subprocess.Popen]]:
    """Start ``setup``'s instances and router; (router URL, decode URLs, processes)."""
    secret = secrets.token_hex(16)
    roles = [("prefill", net[0]), ("decode", net[1]), ("decode", net[2])]
    if setup == "colocated":
        roles = [("both", net[1]), ("both", net[2])]
    procs, listed = [], []
    for role, host in roles:
        path = folder / f"{setup}-{role}-{host.index}.toml"
        path.write_text(toml(instance_config(setup, role, host, args, secret)))
        log = folder / f"{setup}-{role}-{host.index}.log"
        with open(log, "w") as out:
            procs.append(host.popen([sys.executable, "-m", "tandem.cli", "serve", "--config", str(path)],
                                    env=child_env(**UCX_ENV), stdout=out, stderr=subprocess.STDOUT))
        listed.append((f"http://{host.address}:{PORT}", role, log))
    for (url, _, log), proc in zip(listed, procs):
        _wait_healthy(url, proc, log)
    port = free_port()
    path = folder / f"{setup}-router.toml"
    path.write_text(toml(router_config(setup, [(u, r) for u, r, _ in listed], port, args, secret)))
    log = folder / f"{setup}-router.log"
    with open(log, "w") as out:
        router = subprocess.Popen([sys.executable, "-m", "tandem.cli", "router", "--config", str(path),
                                   "--health-interval-s", "0.5"], env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    procs.append(router)
    _wait_healthy(f"http://127.0.0.1:{port}", router, log)
    return f"http://127.0.0.1:{port}", [u for u, r, _ in listed if r != "prefill"], procs


def stop_all(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape_prefixed(url: str, prefix: str) -> dict[str, float]:
    """The samples of ``url``/metrics whose name starts with ``prefix``, by name and labels."""
    return {key: value for key, value in scrape(url).items() if key.startswith(prefix)}


# --------------------------------------------------------------------------- the workload


async def one_turn(client: httpx.AsyncClient, prompt: str, output_len: int) -> tuple[Turn, str]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    turn, text = Turn(prompt_chars=len(prompt)), []
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return turn, ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                turn.error = chunk["error"]["message"]
                return turn, ""
            usage = chunk.get("usage")
            if usage:
                turn.prompt_tokens, turn.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices") or ():
                if not turn.ttft_s:
                    turn.ttft_s = time.perf_counter() - start
                text.append(choice.get("text", ""))
    turn.e2e_s = time.perf_counter() - start
    return turn, "".join(text)


async def conversation(client: httpx.AsyncClient, system: str, user: int, args) -> list[Turn]:
    rng = random.Random(f"user {user} of run {args.seed}")  # never the system prompt's generator
    history, turns = system + "\n", []
    for _ in range(args.turns):
        offered = len(history)
        prompt = f"{history}User: {words(rng, args.user_words)}\nAssistant:"
        turn, answer = await one_turn(client, prompt, args.output_len)
        turn.offered_chars = offered
        turns.append(turn)
        history = f"{prompt}{answer}\n"
    return turns


async def run_workload(router_url: str, args) -> tuple[list[Turn], float]:
    system = words(random.Random(f"system prompt of run {args.seed}"), args.system_words)
    async with httpx.AsyncClient(base_url=router_url, timeout=httpx.Timeout(600.0), trust_env=False) as client:
        start = time.perf_counter()
        per_user = await asyncio.gather(*(conversation(client, system, u, args) for u in range(args.users)))
        return [t for turns in per_user for t in turns], time.perf_counter() - start


def run_setup(setup: str, net: TestHosts, args, folder: Path) -> SetupResult:
    router_url, decode_urls, procs = start_setup(setup, net, args, folder)
    try:
        before = [scrape_prefixed(u, "tandem:kv_transfer_bytes_total") for u in decode_urls]
        turns, wall = asyncio.run(run_workload(router_url, args))
        after = [scrape_prefixed(u, "tandem:kv_transfer_bytes_total") for u in decode_urls]
        paths = {k.removeprefix("tandem:router_requests_total{path=").removesuffix("}"): v
                 for k, v in scrape_prefixed(router_url, "tandem:router_requests_total{").items()}
        kv_bytes = sum(sum(a.values()) - sum(b.values()) for a, b in zip(after, before))
        return SetupResult(turns, wall, kv_bytes, paths)
    finally:
        stop_all(procs)


# --------------------------------------------------------------------------- the report


def summarize(result: SetupResult) -> dict:
    ok = [t for t in result.turns if t.error is None]
    ttft_ms = np.array([t.ttft_s * 1000 for t in ok]) if ok else np.array([math.nan])
    return {"requests": len(result.turns), "errors": len(result.turns) - len(ok),
            "ttft_p50_ms": float(np.percentile(ttft_ms, 50)), "ttft_p99_ms": float(np.percentile(ttft_ms, 99)),
            "output_tok_s": sum(t.output_tokens for t in ok) / result.wall_s,
            "kv_bytes_read": result.kv_bytes,
            "cached_share": sum(t.cached_tokens for t in ok) / max(1, sum(t.prompt_tokens for t in ok)),
            "offered_share": sum(t.offered_chars for t in ok) / max(1, sum(t.prompt_chars for t in ok)),
            "mean_prompt_tokens": float(np.mean([t.prompt_tokens for t in ok])) if ok else math.nan,
            "paths": result.paths, "wall_s": result.wall_s}


def format_table(report: dict) -> str:
    rows = ["| setup | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | KV bytes read | cached share | errors |",
            "|---|---|---|---|---|---|---|"]
    for setup in SETUPS:
        s = report[setup]
        rows.append(f"| {setup} | {s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['output_tok_s']:.1f} | "
                    f"{s['kv_bytes_read'] / 2**20:.1f} MiB | {s['cached_share']:.0%} | {s['errors']} |")
    ratio = report["ttft_p50_ratio"]
    rows.append(f"\nprefix the workload offers: {report['reuse']['offered_share']:.0%} of prompt characters; "
                f"mean prompt {report['reuse']['mean_prompt_tokens']:.0f} tokens")
    rows.append(f"TTFT p50 no_reuse / reuse: {ratio:.2f}x (goal {TTFT_GOAL:.0f}x: "
                f"{'met' if ratio >= TTFT_GOAL else 'NOT met'}); dispatch paths (reuse): {report['reuse']['paths']}")
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder (default: the bench-100m preset, built on first use)")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=300, help="the shared system prompt's length in words")
    p.add_argument("--user-words", type=int, default=20, help="each user message's length in words")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--min-uncached", type=int, default=256,
                   help="reuse setup: disaggregation.min_uncached_prefill_tokens")
    p.add_argument("--instance-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--result-json", metavar="FILE", help="write the report, every request included")


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        from tandem.models.presets import default_model_path

        args.model = str(default_model_path("bench-100m"))
    report: dict = {"model": args.model, "workload": {k: getattr(args, k) for k in
                    ("users", "turns", "system_words", "user_words", "output_len", "min_uncached")},
                    "loadavg_before": os.getloadavg()}
    try:
        with TestHosts(3) as net, tempfile.TemporaryDirectory(prefix="tandem-bench-multiturn-") as folder:
            for setup in args.setups:
                report[setup] = summarize(run_setup(setup, net, args, Path(folder)))
                print(f"{setup}: {report[setup]}", flush=True)
    except HostsUnavailable as exc:
        print(f"tandem bench multiturn needs network namespaces: {exc}", file=sys.stderr)
        return 2
    report["loadavg_after"] = os.getloadavg()
    if all(s in report for s in SETUPS):
        report["ttft_p50_ratio"] = report["no_reuse"]["ttft_p50_ms"] / report["reuse"]["ttft_p50_ms"]
        print(format_table(report))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=1))
    return 0 if all(report[s]["errors"] == 0 for s in args.setups) else 1
