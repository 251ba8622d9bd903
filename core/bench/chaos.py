"""`tandem bench chaos`: a disaggregated cluster under injected KV-transfer faults, every answer
checked against a colocated instance's.

It starts, as separate ``tandem`` processes on 127.0.0.1: a colocated instance (the oracle), a
prefill instance of ``--prefill-tp`` ranks and ``--decode-instances`` decode instances of
``--decode-tp`` ranks (split otherwise than the prefill one, a decode rank reads only its KV
heads), both roles over
the "faulty" KV connector wrapping NIXL (``[fault_injection]``, docs/configuration.md), and a
router over them. The workload is ``--conversations`` multi-turn conversations of ``--turns``
turns, ``--concurrency`` at a time: every prompt starts with one shared system prefix, and each
turn repeats the previous turn's prompt and adds new tokens, so decode instances hold most of a
turn in their prefix cache and hand-overs move only the blocks they lack. Every request is greedy
with a fixed output length and goes to the router and to the oracle; ``--abort-rate`` of the turns
are also sent once more and abandoned by the client within 0.3 s (aborts during hand-overs).

It reports (and exits 1 unless all hold): requests lost (no answer, or an error) = 0; answers
that differ from the oracle's = 0; after the run, within the KV expiry, every instance back to no
running or waiting request, no KV block in use, pinned or quarantined. Then the faults injected
(``tandem:kv_connector_events_total``) beside what the instances observed
(``tandem:kv_transfer_failures_total``: decode-side failed reads, prefill-side expired pins).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.bench.cluster_io import child_env, scrape
from tandem.bench.serve import start_process, stop_server
from tandem.server.supervisor import free_port

MODEL_NAME = "chaos"
SEED_STRIDE = 1000
ABANDON_S = 0.3
STREAM_STEP_TOKENS = 16
"""A streaming prefill instance's --max-num-batched-tokens: one block a step."""
DRAIN_GAUGES = ("tandem:num_requests_running", "tandem:num_requests_waiting", "tandem:kv_blocks_used",
                "tandem:kv_blocks_pending_release", "tandem:kv_blocks_quarantined")
FAULT_FLAGS = ("read_fail_rate", "read_delay_rate", "read_delay_s", "truncate_rate", "notify_drop_rate",
               "notify_delay_rate", "notify_delay_s", "restart_every_n", "seed")


@dataclass(slots=True, frozen=True)
class Cluster:
    oracle: str
    prefill: str
    decode: tuple[str, ...]
    router: str

    @property
    def instances(self) -> tuple[str, ...]:
        return (self.prefill, *self.decode)


@dataclass(slots=True)
class ChaosReport:
    requests: int = 0
    lost: list[str] = field(default_factory=list)
    """Requests without an answer: what happened to each."""
    wrong: list[str] = field(default_factory=list)
    """Requests whose answer differs from the oracle's."""
    leaks: dict[str, dict[str, float]] = field(default_factory=dict)
    """Instance → the gauges not back to zero after the run."""
    injected: dict[str, int] = field(default_factory=dict)
    observed: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0
    """Extra requests whose client hung up early (not counted in ``requests``)."""
    kv_bytes_read: int = 0
    """Read by the decode instances: with their prefix caches, only the blocks they lacked."""
    prompt_tokens_cached: int = 0
    """Prompt tokens the decode instances found in their own prefix caches."""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.wrong or self.leaks)


# ----------------------------------------------------------------------------- the cluster


def instance_env(role: str, secret: str, faults: dict[str, float], expiry_s: float,
                 timeout_s: float, threads: int) -> dict[str, str]:
    env = child_env(TANDEM_ENGINE__NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                    TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET=secret)
    if role == "both":
        return env
    env |= {"TANDEM_DISAGGREGATION__ROLE": role, "TANDEM_DISAGGREGATION__KV_CONNECTOR": "faulty",
            "TANDEM_DISAGGREGATION__KV_EXPIRY_S": str(expiry_s),
            "TANDEM_DISAGGREGATION__KV_TRANSFER_TIMEOUT_S": str(timeout_s),
            "TANDEM_FAULT_INJECTION__INNER_CONNECTOR": "nixl"}
    return env | {f"TANDEM_FAULT_INJECTION__{k.upper()}": str(v) for k, v in faults.items()}


@contextmanager
def running_cluster(model: str, faults: dict[str, float], *, decode_instances: int = 1, decode_tp: int = 1,
                    prefill_tp: int = 1, expiry_s: float = 3.0, transfer_timeout_s: float = 5.0, num_kv_blocks: int = 256,
                    stream_kv: bool = False, log_dir: Path | None = None, timeout_s: float = 300.0):
    """The oracle, the prefill and decode instances and the router, as processes; yields a
    ``Cluster`` and stops them all at the end. Instance logs go to ``log_dir``. ``stream_kv``:
    the prefill instance streams its hand-overs (``disaggregation.stream_kv``), ``STREAM_STEP_TOKENS``
    prompt tokens a step, so a prompt's blocks are announced and read over several steps."""
    secret = secrets.token_urlsafe(24)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    flags = ["--served-model-name", MODEL_NAME, "--num-kv-blocks", str(num_kv_blocks),
             "--max-num-seqs", "16", "--max-num-batched-tokens", "512"]
    with ExitStack() as stack:
        def start(name: str, cmd: list[str], port: int, env: dict[str, str]) -> str:
            log = stack.enter_context(open(log_dir / f"{name}.log", "w"))
            proc, url = start_process(cmd, port, timeout_s, stdout=log, stderr=subprocess.STDOUT, env=env)
            stack.callback(stop_server, proc)
            return url

        def serve(name: str, role: str, index: int = 0, extra: list[str] = (), env: dict[str, str] | None = None) -> str:
            port = free_port()
            cmd = [sys.executable, "-m", "tandem.cli", "serve", model, "--port", str(port), *flags, *extra]
            # each instance its own fault sequence (ranks add their rank to the seed)
            seeded = faults | {"seed": int(faults.get("seed", 0)) + SEED_STRIDE * index}
            return start(name, cmd, port, instance_env(role, secret, seeded, expiry_s, transfer_timeout_s, 1) | (env or {}))

        oracle = serve("oracle", "both")
        steps = ["--max-num-batched-tokens", str(STREAM_STEP_TOKENS)] if stream_kv else []
        prefill = serve("prefill", "prefill", 0, ["--tensor-parallel-size", str(prefill_tp), *steps],
                        {"TANDEM_DISAGGREGATION__STREAM_KV": "true"} if stream_kv else {})
        tp = ["--tensor-parallel-size", str(decode_tp)]
        decode = tuple(serve(f"decode{i}", "decode", i + 1, tp) for i in range(decode_instances))
        listed = [{"url": prefill, "role": "prefill"}] + [{"url": d, "role": "decode"} for d in decode]
        port = free_port()
        env = instance_env("both", secret, {}, expiry_s, transfer_timeout_s, 1) | {
            "TANDEM_DISAGGREGATION__INSTANCES": json.dumps(listed)}
        router = start("router", [sys.executable, "-m", "tandem.cli", "router", "--port", str(port),
                                  "--health-interval-s", "0.5"], port, env)
        yield Cluster(oracle, prefill, decode, router)


# ----------------------------------------------------------------------------- the workload


def conversations(vocab_size: int, count: int, turns: int, seed: int, system_len: int = 40,
                  turn_len: tuple[int, int] = (8, 40)) -> list[list[list[int]]]:
    """``count`` conversations of ``turns`` prompts (token ids), each turn extending the last."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]  # noqa: E731
    system = tokens(system_len)
    result = []
    for _ in range(count):
        prompt, turns_of_one = list(system), []
        for _ in range(turns):
            prompt = prompt + tokens(rng.randint(*turn_len))
            turns_of_one.append(prompt)
        result.append(turns_of_one)
    return result


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0}


async def answer(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> list[str] | str:
    """The greedy tokens of ``url``'s answer, or why there is none."""
    try:
        response = await client.post(f"{url}/v1/completions", json=body(prompt, max_tokens))
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"HTTP {response.status_code}: {response.text[:200]}"
    return response.json()["choices"][0]["logprobs"]["tokens"]


async def abandon(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                  after_s: float) -> None:
    """Send a request and hang up after ``after_s`` (a client that gave up)."""
    try:
        await asyncio.wait_for(client.post(f"{url}/v1/completions", json=body(prompt, max_tokens)), after_s)
    except (TimeoutError, httpx.HTTPError):
        pass


async def run_workload(cluster: Cluster, convs: list[list[list[int]]], max_tokens: int, concurrency: int,
                       report: ChaosReport, abort_rate: float = 0.0, seed: int = 0) -> None:
    """Every conversation's turns in order, ``concurrency`` conversations at a time; each turn
    to the router and to the oracle. Before a turn, with probability ``abort_rate``, the same
    request goes to the router once more and is abandoned within ``ABANDON_S`` (not counted)."""
    queue = list(enumerate(convs))
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=30.0)) as client:
        async def worker() -> None:
            while queue:
                index, turns = queue.pop(0)
                for turn, prompt in enumerate(turns):
                    if rng.random() < abort_rate:
                        report.abandoned += 1
                        await abandon(client, cluster.router, prompt, max_tokens, rng.uniform(0, ABANDON_S))
                    got, expected = await asyncio.gather(answer(client, cluster.router, prompt, max_tokens),
                                                         answer(client, cluster.oracle, prompt, max_tokens))
                    report.requests += 1
                    name = f"conversation {index} turn {turn}"
                    if isinstance(expected, str):
                        raise RuntimeError(f"the oracle did not answer {name}: {expected}")
                    if isinstance(got, str):
                        report.lost.append(f"{name}: {got}")
                    elif got != expected:
                        report.wrong.append(f"{name}: {got} != {expected}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


# ----------------------------------------------------------------------------- the checks


def undrained(url: str) -> dict[str, float]:
    metrics = scrape(url)
    return {g: metrics.get(g, 0.0) for g in DRAIN_GAUGES if metrics.get(g, 0.0) != 0}


def wait_drained(urls: tuple[str, ...], timeout_s: float) -> dict[str, dict[str, float]]:
    """The gauges of each instance that are not back to zero after ``timeout_s`` (empty: all are)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = {url: left for url in urls if (left := undrained(url))}
        if not leaks or time.monotonic() >= deadline:
            return leaks
        time.sleep(0.25)


def labelled(metrics: dict[str, float], name: str, label: str) -> dict[str, int]:
    prefix = f"{name}{{{label}="
    return {key[len(prefix):-1]: int(v) for key, v in metrics.items() if key.startswith(prefix) and v}


def count_faults(cluster: Cluster, report: ChaosReport) -> None:
    """Injected faults and observed failures, summed over the instances (the counters are read
    at most ``EVENTS_REFRESH_S`` late: wait that long first)."""
    for url in cluster.instances:
        metrics = scrape(url)
        for event, n in labelled(metrics, "tandem:kv_connector_events_total", "event").items():
            report.injected[event] = report.injected.get(event, 0) + n
        for reason, n in labelled(metrics, "tandem:kv_transfer_failures_total", "reason").items():
            report.observed[reason] = report.observed.get(reason, 0) + n
        if url in cluster.decode:
            report.kv_bytes_read += int(metrics.get("tandem:kv_transfer_bytes_total", 0))
            report.prompt_tokens_cached += int(metrics.get("tandem:prefix_cache_hits_total", 0))


def run_chaos(model: str, faults: dict[str, float], *, conversations_: int, turns: int, max_tokens: int,
              concurrency: int, seed: int, decode_instances: int = 1, decode_tp: int = 1, prefill_tp: int = 1,
              abort_rate: float = 0.0, expiry_s: float = 3.0, transfer_timeout_s: float = 5.0, stream_kv: bool = False,
              log_dir: Path | None = None) -> ChaosReport:
    """Start the cluster, run the workload, check it drains, count the faults."""
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    convs = conversations(vocab_size, conversations_, turns, seed)
    report = ChaosReport()
    with running_cluster(model, faults, decode_instances=decode_instances, decode_tp=decode_tp,
                         prefill_tp=prefill_tp, expiry_s=expiry_s, transfer_timeout_s=transfer_timeout_s,
                         stream_kv=stream_kv, log_dir=log_dir) as cluster:
        t0 = time.perf_counter()
        asyncio.run(run_workload(cluster, convs, max_tokens, concurrency, report, abort_rate, seed))
        report.duration_s = time.perf_counter() - t0
        report.leaks = wait_drained((*cluster.instances, cluster.oracle), expiry_s + transfer_timeout_s + 5)
        time.sleep(1.5)
        count_faults(cluster, report)
    return report


def format_report(report: ChaosReport) -> str:
    lines = [f"requests {report.requests} (and {report.abandoned} abandoned) in {report.duration_s:.1f} s: "
             f"lost {len(report.lost)}, "
             f"answers differing from the colocated instance {len(report.wrong)}, "
             f"instances not drained {len(report.leaks)}",
             f"decode instances: {report.kv_bytes_read / 2**20:.1f} MiB of KV read, "
             f"{report.prompt_tokens_cached} prompt tokens found in their own prefix caches",
             "faults injected:   " + ", ".join(f"{k} {v}" for k, v in sorted(report.injected.items())),
             "failures observed: " + ", ".join(f"{k} {v}" for k, v in sorted(report.observed.items()))]
    lines += [f"  lost: {x}" for x in report.lost[:10]] + [f"  wrong: {x}" for x in report.wrong[:10]]
    lines += [f"  not drained: {url} {left}" for url, left in report.leaks.items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model folder (e.g. one made by `tandem make-demo-model`)")
    p.add_argument("--conversations", type=int, default=60)
    p.add_argument("--turns", type=int, default=5, help="requests per conversation (default 60 x 5 = 300)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=6, help="conversations in flight")
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel ranks of each decode instance")
    p.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel ranks of the prefill instance")
    p.add_argument("--abort-rate", type=float, default=0.05,
                   help="before a turn, send it once more and hang up within 0.3 s (default 0.05)")
    p.add_argument("--stream-kv", action="store_true",
                   help=f"the prefill instance streams its hand-overs ({STREAM_STEP_TOKENS} prompt tokens a step)")
    p.add_argument("--kv-expiry-s", type=float, default=3.0)
    p.add_argument("--kv-transfer-timeout-s", type=float, default=5.0)
    p.add_argument("--log-dir", type=Path, default=None)
    defaults = {"read_fail_rate": 0.01, "read_delay_rate": 0.01, "read_delay_s": 0.2, "truncate_rate": 0.01,
                "notify_drop_rate": 0.01, "notify_delay_rate": 0.01, "notify_delay_s": 0.5,
                "restart_every_n": 50, "seed": 0}
    for name in FAULT_FLAGS:
        kind = int if name in ("restart_every_n", "seed") else float
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=defaults[name],
                       help=f"[fault_injection] {name} of both roles (default {defaults[name]})")


def run(args: argparse.Namespace) -> int:
    faults = {name: getattr(args, name) for name in FAULT_FLAGS}
    report = run_chaos(args.model, faults, conversations_=args.conversations, turns=args.turns,
                       max_tokens=args.max_tokens, concurrency=args.concurrency, seed=args.seed,
                       decode_instances=args.decode_instances, decode_tp=args.decode_tp, prefill_tp=args.prefill_tp,
                       abort_rate=args.abort_rate, stream_kv=args.stream_kv,
                       expiry_s=args.kv_expiry_s, transfer_timeout_s=args.kv_transfer_timeout_s,
                       log_dir=args.log_dir)
    print(format_report(report))
    return 0 if report.ok else 1
