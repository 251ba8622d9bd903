"""`tandem bench disagg-ttft`: time to first token of a disaggregated request by prompt length,
the whole-request hand-over against a streamed one (``disaggregation.stream_kv``), in one run.

Layout (``--hosts netns``, as root: two test hosts, ``tandem.bench.netns``; KV over NIXL with
``UCX_TLS=tcp`` across the veth bridge; ``--hosts none``: everything on 127.0.0.1)::

    host 1   prefill, whole hand-overs      :8000     prefill, streamed hand-overs   :8001
    host 2   decode                         :8000
    here     one router per prefill instance (127.0.0.1), the client

Every instance has ``--instance-threads`` torch threads and ``--chunk`` tokens per step
(``max_num_batched_tokens``: a streamed hand-over is announced once per chunk). For each repeat
and each ``--lengths`` entry, one request of fresh random token ids (no prefix-cache hit
anywhere) goes through each router, whole first or streamed first in turn, one at a time, streamed
to the client, ``max_tokens`` 2; TTFT is the time to its first token event. Reported: the median
TTFT of each (length, mode), and streamed / whole; then the same for TTFT less the prefill
instance's own TTFT of that request (its prefill time, from its /metrics): what the hand-over
adds, the part streaming can hide. On a machine where prefill compute dominates (a CPU) the
first ratio cannot go far below 1: only the hand-over's part overlaps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tandem.bench.checkpoint import model_path
from tandem.bench.netns import HOST_DEVICE, HostsUnavailable, TestHosts
from tandem.bench.serve import random_requests
from tandem.server.supervisor import free_port

MODES = ("whole", "streamed")
_READY_S = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a model folder, .gguf file or preset name (default bench-100m)")
    p.add_argument("--lengths", default="512,2048,4000",
                   help="comma-separated prompt lengths in tokens (each plus 2 within the context)")
    p.add_argument("--repeats", type=int, default=5, help="requests per length and mode")
    p.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens of every instance")
    p.add_argument("--instance-threads", type=int, default=1, help="torch threads of each instance")
    p.add_argument("--hosts", choices=["netns", "none"], default="netns",
                   help="netns: prefill and decode on two network namespaces (needs root); none: 127.0.0.1")
    p.add_argument("--json", default=None, help="also write the raw TTFTs here")


@dataclass(slots=True)
class _Proc:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path


def run(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    path = model_path(args.model)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-ttft-")))
        try:
            hosts = stack.enter_context(TestHosts(2)) if args.hosts == "netns" else None
        except HostsUnavailable as exc:
            print(f"--hosts netns: {exc}", file=sys.stderr)
            return 2
        procs = _start_cluster(path, args, hosts, workdir)
        stack.callback(_stop_all, procs)
        for proc in procs:
            _wait_ready(proc)
        routers = {mode: (procs[-2 + i].url, procs[i].url) for i, mode in enumerate(MODES)}
        ttfts, overheads = _measure(routers, path, lengths, args.repeats)
    _report(ttfts, overheads, lengths, args)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{kind}:{m}:{n}": v for kind, table in
                                               (("ttft", ttfts), ("overhead", overheads))
                                               for (m, n), v in table.items()}, indent=1))
    return 0


def _start_cluster(path: str, args: argparse.Namespace, hosts: TestHosts | None, workdir: Path) -> list[_Proc]:
    secret = secrets.token_hex(16)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")},
           "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": secret, "OMP_NUM_THREADS": str(args.instance_threads),
           "TANDEM_ENGINE__NUM_THREADS": str(args.instance_threads),
           "UCX_TLS": "tcp"}
    if hosts is not None:
        env["UCX_NET_DEVICES"] = HOST_DEVICE
    max_len = max(int(x) for x in args.lengths.split(",")) + 2
    flags = ["--max-num-batched-tokens", str(args.chunk), "--max-model-len", str(max_len)]
    procs = []
    layout = [("prefill-whole", 0, "prefill", False), ("prefill-streamed", 0, "prefill", True),
              ("decode", 1, "decode", False)]
    for name, host_index, role, stream in layout:
        address = hosts[host_index].address if hosts is not None else "127.0.0.1"
        port = (8000 + stream) if hosts is not None else free_port()
        argv = [sys.executable, "-m", "tandem.cli", "serve", path, "--host", address, "--port", str(port),
                *flags]
        child = {**env, "TANDEM_DISAGGREGATION__ROLE": role, "TANDEM_DISAGGREGATION__KV_CONNECTOR": "nixl",
                 "TANDEM_DISAGGREGATION__STREAM_KV": str(stream).lower()}
        procs.append(_spawn(name, argv, child, f"http://{address}:{port}", workdir,
                            hosts[host_index] if hosts is not None else None))
    decode_url = procs[2].url
    for mode, prefill in zip(MODES, procs[:2]):
        port = free_port()
        config = workdir / f"router-{mode}.toml"
        config.write_text(f'[server]\nhost = "127.0.0.1"\nport = {port}\n[disaggregation]\n'
                          f'kv_transfer_secret = "{secret}"\ninstances = [{{url = "{prefill.url}", '
                          f'role = "prefill"}}, {{url = "{decode_url}", role = "decode"}}]\n')
        config.chmod(0o600)
        argv = [sys.executable, "-m", "tandem.cli", "router", "--config", str(config)]
        procs.append(_spawn(f"router-{mode}", argv, env, f"http://127.0.0.1:{port}", workdir, None))
    return procs


def _spawn(name: str, argv: list[str], env: dict, url: str, workdir: Path, host) -> _Proc:
    log = workdir / f"{name}.log"
    with open(log, "w") as out:
        if host is not None:
            proc = host.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    return _Proc(name, proc, url, log)


def _wait_ready(proc: _Proc) -> None:
    deadline = time.monotonic() + _READY_S
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{proc.url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{proc.name} did not start:\n{proc.log.read_text()[-3000:]}")


def _stop_all(procs: list[_Proc]) -> None:
    for proc in reversed(procs):
        proc.proc.terminate()
    for proc in procs:
        try:
            proc.proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.proc.kill()


def _measure(routers: dict[str, tuple[str, str]], path: str, lengths: list[int], repeats: int):
    """TTFTs through each mode's router, and the same less its prefill instance's own TTFT (what
    the hand-over adds to the prefill: router hops, KV reads, the decode step)."""
    ttfts: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in lengths}
    overheads: dict[tuple[str, int], list[float]] = {(m, n): [] for m in MODES for n in lengths}
    prompts = {n: [r.prompt for r in random_requests(path, repeats * len(MODES), (n, n), (2, 2), seed=n)]
               for n in [64, *lengths]}
    with httpx.Client(timeout=600, trust_env=False) as client:
        for i, mode in enumerate(MODES):  # warm-up: the first hand-over pays the handshake and set-up
            _ttft(client, routers[mode][0], prompts[64][i])
        for repeat in range(repeats):
            for n in lengths:
                order = MODES if (repeat + n) % 2 == 0 else MODES[::-1]
                for i, mode in enumerate(order):
                    router, prefill = routers[mode]
                    before = _prefill_seconds(client, prefill)
                    ttft = _ttft(client, router, prompts[n][repeat * len(MODES) + i])
                    ttfts[(mode, n)].append(ttft)
                    overheads[(mode, n)].append(ttft - (_prefill_seconds(client, prefill) - before))
            print(f"repeat {repeat + 1}/{repeats} done", file=sys.stderr)
    return ttfts, overheads


def _prefill_seconds(client: httpx.Client, url: str) -> float:
    """The sum of the prefill instance's TTFTs so far (its requests' prefill times)."""
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("tandem:time_to_first_token_seconds_sum "):
            return float(line.split()[1])
    raise RuntimeError(f"{url}/metrics has no tandem:time_to_first_token_seconds_sum")


def _ttft(client: httpx.Client, url: str, prompt: list[int]) -> float:
    """Seconds to the first token event; the stream is read to its end."""
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read()[:500]!r}")
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"{url} streamed no token")
    return ttft


def _report(ttfts: dict, overheads: dict, lengths: list[int], args: argparse.Namespace) -> None:
    where = ("two network namespaces, UCX_TLS=tcp over a veth bridge" if args.hosts == "netns"
             else "127.0.0.1, UCX_TLS=tcp")
    print(f"\nmedians over {args.repeats} requests each; {where}; chunk {args.chunk} tokens; "
          f"{args.instance_threads} thread(s) per instance; {os.cpu_count()} CPUs")
    print("| prompt tokens | TTFT whole (s) | TTFT streamed (s) | streamed / whole "
          "| TTFT − prefill, whole (s) | TTFT − prefill, streamed (s) | streamed / whole |")
    print("|---|---|---|---|---|---|---|")
    for n in lengths:
        whole, streamed = (statistics.median(ttfts[(m, n)]) for m in MODES)
        extra_whole, extra_streamed = (statistics.median(overheads[(m, n)]) for m in MODES)
        print(f"| {n} | {whole:.3f} | {streamed:.3f} | {streamed / whole:.2f} | {extra_whole:.3f} "
              f"| {extra_streamed:.3f} | {extra_streamed / extra_whole:.2f} |")
