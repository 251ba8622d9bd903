"""`tandem bench kv-transfer`: the KV hand-over of one realistic request through a KV connector,
on one host and between two test hosts, against an in-process torch copy of the same scattered
blocks, in one run.

Layout (the defaults): bench-100m's KV pool, ``[num_blocks, 8 layers, K/V, 16 tokens, 4 KV heads,
64]`` float32, so one block is 8 * 2 * 16 * 4 * 64 * 4 bytes = 256 KiB. The request: 2,000 prompt
tokens = 125 blocks, at random ids of a pool that an owner process owns, read into other random
ids of a reader process's pool; the reader's clock runs from ``start_read`` until ``poll`` reports
"done", and it checks the bytes it got against the owner's seeded pool. Each route is one owner
and one reader process (both spawned here, talking JSON lines over their stdin/stdout)::

    same host, UCX's choice    owner and reader here, UCX picks its transports (shared memory)
    same host, UCX_TLS=tcp     owner and reader here, TCP over the loopback device only
    two hosts, UCX_TLS=tcp     owner in test host 1, reader in test host 2 (network namespaces on
                               a veth bridge, tandem.bench.netns; needs root): TCP across the
                               bridge, whose counters show the bytes that reached the reader's host

``--reader-tp N`` makes the reader tensor rank 0 of a tp=N decode instance reading from a tp=1
owner: its pool holds 1/N of the KV heads and it reads exactly those, one descriptor per
(layer, K/V, token) run instead of one per block (``tandem.transport.shard_plan``); the copy
baseline then copies the same strided heads.

``--hosts auto`` (the default) measures the last route where namespaces can be made and says why
not elsewhere; ``--hosts netns`` requires it; ``--hosts none`` skips it.

The baseline copies the same scattered blocks between two pools of the same layout in this
process, one ``copy_`` per block on one torch thread by default (the fastest torch way:
``index_select`` + ``index_copy_`` copies twice, and two threads on a busy two-core machine stall
at every block). Rounds alternate between the copy and every route, so
that all see the same machine; each runs ``--repeats`` times after ``--warmup`` rounds and the
medians are compared (target: the same-host read reaches at least 50% of the copy's bandwidth;
the two-host figure is printed against both same-host ones).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from tandem.bench.netns import HOST_DEVICE, HostsUnavailable, TestHosts

TARGET_RATIO = 0.5
_START_TIMEOUT_S = 180.0
_READ_TIMEOUT_S = 60.0
_TCP_ENV = {"UCX_TLS": "tcp"}


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    reader_tp: int = 1
    """The reader is tensor rank 0 of this many: it holds and reads num_kv_heads / reader_tp heads."""

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def reader_heads(self) -> int:
        return self.num_kv_heads // self.reader_tp

    @property
    def reader_shape(self) -> tuple[int, ...]:
        return (*self.shape[:4], self.reader_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * 4

    @property
    def read_bytes(self) -> int:
        """Bytes of one block the reader reads: its heads."""
        return self.block_bytes // self.reader_tp

    def reader_shards(self) -> list:
        from tandem.interfaces import KVShard

        h = self.reader_heads
        return [KVShard(0, self.num_layers, r * h, (r + 1) * h, self.block_size, self.head_dim, 4)
                for r in range(self.reader_tp)]


Request = tuple[list[int], list[int]]
"""(remote block ids, local block ids) of one hand-over."""


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where the owner and the reader run: ``label`` as printed, ``env`` added to both processes'
    environment, ``across_hosts`` puts them in two test hosts."""

    label: str
    env: dict[str, str]
    across_hosts: bool = False


SAME_HOST = Route("same host, shm (UCX's choice)", {})
SAME_HOST_TCP = Route("same host, TCP over lo", {**_TCP_ENV, "UCX_NET_DEVICES": "lo"})
TWO_HOSTS_TCP = Route("two hosts, TCP over a veth bridge",
                      {**_TCP_ENV, "UCX_NET_DEVICES": HOST_DEVICE}, across_hosts=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connector", default="nixl", help="KV connector plugin (must work between "
                   "processes; default: nixl)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens handed over (default: 2000)")
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each pool (default: 1024)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reader-tp", type=int, default=1, help="the reader is tensor rank 0 of this "
                   "many, reading its share of the KV heads from a tp=1 owner (default: 1, whole "
                   "blocks)")
    p.add_argument("--repeats", type=int, default=20, help="measured rounds of each (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first (default: 3)")
    p.add_argument("--copy-threads", type=int, default=1, help="torch threads of the copy (default: "
                   "1, as NIXL's shared-memory read runs on one thread)")
    p.add_argument("--hosts", choices=["auto", "netns", "none"], default="auto",
                   help="also read between two test hosts (network namespaces on a veth bridge, "
                   "over UCX_TLS=tcp; needs root): auto = when they can be made, netns = required, "
                   "none = same host only (default: auto)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    layout = Layout(args.pool_blocks, args.num_layers, args.block_size, args.num_kv_heads, args.head_dim,
                    args.reader_tp)
    if args.reader_tp < 1 or args.num_kv_heads % args.reader_tp:
        raise SystemExit(f"--reader-tp {args.reader_tp} must divide --num-kv-heads {args.num_kv_heads}")
    num_blocks = -(-args.prompt_tokens // args.block_size)
    if num_blocks > layout.num_blocks:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} needs {num_blocks} blocks; "
                         f"--pool-blocks is {layout.num_blocks}")
    rng = random.Random(args.seed)
    requests = [(rng.sample(range(layout.num_blocks), num_blocks),
                 rng.sample(range(layout.num_blocks), num_blocks))
                for _ in range(args.warmup + args.repeats)]
    nbytes = num_blocks * layout.read_bytes
    print(f"KV hand-over: {num_blocks} scattered blocks ({args.prompt_tokens} tokens) of "
          f"{layout.block_bytes // 1024} KiB = {num_blocks * layout.block_bytes / 2**20:.1f} MiB; median of "
          f"{args.repeats} rounds after {args.warmup} warm-up, the copy and each route alternating", flush=True)
    if layout.reader_tp > 1:
        runs = num_blocks * layout.num_layers * 2 * layout.block_size
        print(f"  reader: tensor rank 0 of {layout.reader_tp}, {layout.reader_heads} of "
              f"{layout.num_kv_heads} KV heads: {runs} descriptors of "
              f"{layout.reader_heads * layout.head_dim * 4} bytes = {nbytes / 2**20:.1f} MiB per read",
              flush=True)
    with contextlib.ExitStack() as stack:
        try:
            hosts = _test_hosts(args.hosts, stack)
            routes = [SAME_HOST, SAME_HOST_TCP] + ([TWO_HOSTS_TCP] if hosts is not None else [])
            bridged = hosts.bytes_to_host(2) if hosts is not None else 0
            seconds = _measure(args, layout, requests, routes, hosts, stack)
            bridged = hosts.bytes_to_host(2) - bridged if hosts is not None else 0
        except BenchError as exc:
            print(f"  {exc}")
            return 1
    _report(args.connector, nbytes, seconds)
    if hosts is not None:
        print(f"  to the reader's host over the veth bridge: {bridged / 2**20:.1f} MiB for "
              f"{len(requests)} reads of {nbytes / 2**20:.1f} MiB")
    return 0


def _test_hosts(mode: str, stack: contextlib.ExitStack) -> TestHosts | None:
    """Two test hosts (a ``TestHosts``) entered on ``stack``; None when ``mode`` is "none" or,
    for "auto", when they cannot be made (said on stdout)."""
    if mode == "none":
        return None
    try:
        return stack.enter_context(TestHosts(2))
    except HostsUnavailable as exc:
        if mode == "netns":
            raise BenchError(f"two hosts: not measured: {exc}") from exc
        print(f"  two hosts: not measured: {exc}", flush=True)
        return None


def _measure(args: argparse.Namespace, layout: Layout, requests: list[Request], routes: list[Route],
             hosts: TestHosts | None, stack: contextlib.ExitStack) -> dict[str, float]:
    """The median seconds of the copy (key "copy") and of each route's read (its label)."""
    copy = TorchCopy(layout, args.copy_threads)
    readers = {r.label: stack.enter_context(PeerRead(args.connector, layout, args.seed, r, hosts))
               for r in routes}
    times: dict[str, list[float]] = {"copy": [], **{label: [] for label in readers}}
    for i, request in enumerate(requests):
        times["copy"].append(copy.time(request))
        for label, reader in readers.items():
            times[label].append(reader.time(f"bench-{i}", request))
    return {k: statistics.median(v[args.warmup:]) for k, v in times.items()}


def _report(connector: str, nbytes: int, seconds: dict[str, float]) -> None:
    def row(label: str, s: float, note: str = "") -> None:
        print(f"  {label:<44} {s * 1e3:8.2f} ms  {nbytes / s / 2**30:6.2f} GiB/s{note}")

    row("torch copy, in-process", seconds["copy"])
    for route in (SAME_HOST, SAME_HOST_TCP, TWO_HOSTS_TCP):
        if route.label in seconds:
            row(f"{connector} read, {route.label}", seconds[route.label], "  (bytes verified)")
    ratio = seconds["copy"] / seconds[SAME_HOST.label]
    verdict = "met" if ratio >= TARGET_RATIO else "missed"
    print(f"  {connector} / torch copy: {ratio:.0%} (target ≥ {TARGET_RATIO:.0%}: {verdict})")
    if TWO_HOSTS_TCP.label in seconds:
        across = seconds[TWO_HOSTS_TCP.label]
        print(f"  two hosts / same host tcp: {seconds[SAME_HOST_TCP.label] / across:.0%}; "
              f"two hosts / same host shm: {seconds[SAME_HOST.label] / across:.0%}")


class BenchError(Exception):
    """A read that failed or returned other bytes than the owner's, or a process that failed."""


class TorchCopy:
    """Two pools of ``layout`` in this process; copies a request's blocks one ``copy_`` each, on
    ``threads`` torch threads."""

    def __init__(self, layout: Layout, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.src = torch.randn(layout.shape)
        self.dst = torch.zeros(layout.reader_shape)
        self.heads = layout.reader_heads

    def time(self, request: Request) -> float:
        remote_ids, local_ids = request
        started = time.perf_counter()
        for remote_id, local_id in zip(remote_ids, local_ids):
            self.dst[local_id].copy_(self.src[remote_id, :, :, :, :self.heads])
        return time.perf_counter() - started


class PeerRead:
    """An owner process whose pool is ``seeded_pool(layout, seed)`` and a reader process, both
    with connector ``name``, placed as ``route`` says (``hosts``: the two test hosts, for a route
    across hosts); ``time`` has the reader read a request's blocks and check them."""

    def __init__(self, name: str, layout: Layout, seed: int, route: Route,
                 hosts: TestHosts | None = None) -> None:
        assert hosts is not None or not route.across_hosts
        self.name, self.layout, self.seed, self.route, self.hosts = name, layout, seed, route, hosts
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> PeerRead:
        spec = json.dumps([*dataclasses.astuple(self.layout), self.seed])
        try:
            self.owner = self._spawn("--serve-pool", spec, host=0)
            self.reader = self._spawn("--read-pool", spec, host=1)
            _send(self.reader, self._receive(self.owner, _START_TIMEOUT_S))
            ready = self._receive(self.reader, _START_TIMEOUT_S)
            if "error" in ready:
                raise BenchError(f"{self.name} read failed, {self.route.label}: {ready['error']}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _spawn(self, flag: str, spec: str, host: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "tandem.bench.kv_transfer", flag, self.name, spec]
        env = {**os.environ, **self.route.env}
        kwargs = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.route.across_hosts:
            proc = self.hosts[host].popen(argv, **kwargs)
        else:
            proc = subprocess.Popen(argv, **kwargs)
        self.procs.append(proc)
        return proc

    def time(self, transfer_id: str, request: Request) -> float:
        remote_ids, local_ids = request
        _send(self.reader, {"id": transfer_id, "remote": remote_ids, "local": local_ids})
        answer = self._receive(self.reader, _READ_TIMEOUT_S)
        if "error" in answer:
            raise BenchError(f"{self.name} read failed, {self.route.label}: {answer['error']}")
        return answer["seconds"]

    def _receive(self, proc: subprocess.Popen, timeout_s: float) -> dict:
        """The next JSON line of ``proc``'s stdout (other lines are skipped)."""
        what = f"the {'owner' if proc is self.owner else 'reader'} process ({self.route.label})"
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([proc.stdout], [], [], left)[0]:
                break
            line = proc.stdout.readline()
            if not line:
                raise BenchError(f"{what} exited with status {proc.wait()}")
            if line.startswith("{"):
                return json.loads(line)
        raise BenchError(f"no answer from {what} within {timeout_s:.0f} s")


def _send(proc: subprocess.Popen, message: dict) -> None:
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()


def seeded_pool(layout: Layout, seed: int):
    import torch

    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed))


def _compat(layout: Layout) -> str:
    from tandem.interfaces import compat_hash

    return compat_hash(model="bench-kv-transfer", dtype="float32", num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       block_size=layout.block_size)


@contextlib.contextmanager
def _registered(name: str, layout: Layout, pool, shards=None) -> Iterator:
    """Connector ``name`` with ``pool`` (of ``layout``; rank 0 of ``shards`` when given)
    registered, closed at the end."""
    from tandem.interfaces import KVPoolDescriptor
    from tandem.plugin_manager import get_registry

    connector = get_registry().get("kv_connector", name)()
    try:
        connector.register_pool(pool, KVPoolDescriptor.for_pool(pool, _compat(layout), shards))
        yield connector
    finally:
        connector.close()


def _serve_pool(name: str, layout: Layout, seed: int) -> None:
    """The owner process: registers ``seeded_pool``, prints its handshake as one JSON line, then
    drains notifications until its stdin closes."""
    with _registered(name, layout, seeded_pool(layout, seed)) as connector:
        print(json.dumps(connector.handshake_info()), flush=True)
        while not select.select([sys.stdin], [], [], 0.05)[0] or sys.stdin.read(1):
            connector.get_notifications()


def _read_pool(name: str, layout: Layout, seed: int) -> None:
    """The reader process: its first stdin line is the owner's handshake (answered
    ``{"ready": true}``); each next line, ``{"id", "remote", "local"}``, is read and answered
    ``{"seconds": S}`` (from ``start_read`` to "done", bytes checked) or ``{"error": ...}``."""
    import torch

    expected = seeded_pool(layout, seed)[:, :, :, :, :layout.reader_heads]
    pool = torch.zeros(layout.reader_shape)
    with _registered(name, layout, pool, layout.reader_shards()) as connector:
        try:
            peer = connector.add_peer(json.loads(sys.stdin.readline()))
        except Exception as exc:  # noqa: BLE001 — reported to the bench, which stops
            print(json.dumps({"error": f"add_peer: {type(exc).__name__}: {exc}"}), flush=True)
            return
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            ask = json.loads(line)
            print(json.dumps(_one_read(connector, peer, pool, expected, ask, layout.read_bytes)), flush=True)


def _one_read(connector, peer: str, pool, expected, ask: dict, read_bytes: int) -> dict:
    """One read, checked: the owner's bytes of the reader's heads, and no more bytes read (the
    connector's counters) than those."""
    import torch

    counted = connector.read_counters()[0].bytes_read
    started = time.perf_counter()
    connector.start_read(ask["id"], peer, ask["remote"], ask["local"], deadline_s=_READ_TIMEOUT_S)
    outcome: dict[str, str] = {}
    while not outcome:
        outcome = connector.poll()
    seconds = time.perf_counter() - started
    if outcome.get(ask["id"]) != "done":
        return {"error": f"{ask['id']}: {outcome}"}
    if not torch.equal(pool[ask["local"]], expected[ask["remote"]]):
        return {"error": f"{ask['id']} returned other bytes than the owner's blocks"}
    counted = connector.read_counters()[0].bytes_read - counted
    if counted != len(ask["local"]) * read_bytes:
        return {"error": f"{ask['id']} read {counted} bytes, not {len(ask['local'])} × {read_bytes}"}
    return {"seconds": seconds}


if __name__ == "__main__":
    _, flag, connector_name, spec = sys.argv
    *dims, pool_seed = json.loads(spec)
    {"--serve-pool": _serve_pool, "--read-pool": _read_pool}[flag](connector_name, Layout(*dims), pool_seed)
