"""`tandem bench kv-transfer`: the KV hand-over of one realistic request through a KV connector,
against an in-process torch copy of the same scattered blocks, in one run.

Layout (the defaults): bench-100m's KV pool, ``[num_blocks, 8 layers, K/V, 16 tokens, 4 KV heads,
64]`` float32, so one block is 8 * 2 * 16 * 4 * 64 * 4 bytes = 256 KiB. The request: 2,000 prompt
tokens = 125 blocks, at random ids of a pool that another process (spawned here) owns, read into
other random ids of this process's pool; the clock runs from ``start_read`` until ``poll`` reports
"done". The baseline copies the same scattered blocks between two pools of the same layout in this
process, one ``copy_`` per block on one torch thread by default (the fastest torch way measured:
``index_select`` + ``index_copy_`` copies twice and took 1.8x as long, and two threads on a busy
two-core machine stall at every block). Copy and read rounds alternate, so that both see the same
machine; each runs ``--repeats`` times after ``--warmup`` rounds and the medians are compared
(target: the connector reaches at least 50% of the copy's bandwidth).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import select
import statistics
import subprocess
import sys
import time

TARGET_RATIO = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * 4


Request = tuple[list[int], list[int]]
"""(remote block ids, local block ids) of one hand-over."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connector", default="nixl", help="KV connector plugin (must work between "
                   "processes; default: nixl)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="tokens handed over (default: 2000)")
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each pool (default: 1024)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20, help="measured rounds of each (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured rounds first (default: 3)")
    p.add_argument("--copy-threads", type=int, default=1, help="torch threads of the copy (default: "
                   "1, as NIXL's shared-memory read runs on one thread)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    layout = Layout(args.pool_blocks, args.num_layers, args.block_size, args.num_kv_heads, args.head_dim)
    num_blocks = -(-args.prompt_tokens // args.block_size)
    if num_blocks > layout.num_blocks:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} needs {num_blocks} blocks; "
                         f"--pool-blocks is {layout.num_blocks}")
    rng = random.Random(args.seed)
    requests = [(rng.sample(range(layout.num_blocks), num_blocks),
                 rng.sample(range(layout.num_blocks), num_blocks))
                for _ in range(args.warmup + args.repeats)]
    nbytes = num_blocks * layout.block_bytes
    print(f"KV hand-over: {num_blocks} scattered blocks ({args.prompt_tokens} tokens) of "
          f"{layout.block_bytes // 1024} KiB = {nbytes / 2**20:.1f} MiB; median of {args.repeats} "
          f"rounds after {args.warmup} warm-up, copy and read alternating", flush=True)
    copy = TorchCopy(layout, args.copy_threads)
    copy_times, read_times = [], []
    try:
        with ConnectorRead(args.connector, layout, args.seed) as read:
            for i, request in enumerate(requests):
                copy_times.append(copy.time(request))
                read_times.append(read.time(f"bench-{i}", request))
    except BenchError as exc:
        print(f"  {args.connector} read failed: {exc}")
        return 1
    copy_s = statistics.median(copy_times[args.warmup:])
    read_s = statistics.median(read_times[args.warmup:])
    print(f"  torch copy, in-process        {copy_s * 1e3:8.2f} ms  {nbytes / copy_s / 2**30:6.2f} GiB/s")
    print(f"  {args.connector + ' read, other process':<29} {read_s * 1e3:8.2f} ms  "
          f"{nbytes / read_s / 2**30:6.2f} GiB/s  (bytes verified)")
    ratio = copy_s / read_s
    verdict = "met" if ratio >= TARGET_RATIO else "missed"
    print(f"  {args.connector} / torch copy: {ratio:.0%} (target ≥ {TARGET_RATIO:.0%}: {verdict})")
    return 0


class BenchError(Exception):
    """A read that failed or returned other bytes than the owner's."""


class TorchCopy:
    """Two pools of ``layout`` in this process; copies a request's blocks one ``copy_`` each, on
    ``threads`` torch threads."""

    def __init__(self, layout: Layout, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.src = torch.randn(layout.shape)
        self.dst = torch.zeros(layout.shape)

    def time(self, request: Request) -> float:
        remote_ids, local_ids = request
        started = time.perf_counter()
        for remote_id, local_id in zip(remote_ids, local_ids):
            self.dst[local_id].copy_(self.src[remote_id])
        return time.perf_counter() - started


class ConnectorRead:
    """This process's pool and connector ``name``, a peer of an owner process started here whose
    pool is ``seeded_pool(layout, seed)``; ``time`` reads a request's blocks and checks them."""

    def __init__(self, name: str, layout: Layout, seed: int) -> None:
        self.name, self.layout, self.seed = name, layout, seed

    def __enter__(self) -> ConnectorRead:
        import torch

        from tandem.interfaces import KVPoolDescriptor
        from tandem.plugin_manager import get_registry

        spec = json.dumps([*dataclasses.astuple(self.layout), self.seed])
        self.owner = subprocess.Popen(
            [sys.executable, "-m", "tandem.bench.kv_transfer", "--serve-pool", self.name, spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pool = torch.zeros(self.layout.shape)
        self.expected = seeded_pool(self.layout, self.seed)
        self.connector = get_registry().get("kv_connector", self.name)()
        try:
            self.connector.register_pool(self.pool, KVPoolDescriptor.for_pool(self.pool, _compat(self.layout)))
            self.peer = self.connector.add_peer(json.loads(self.owner.stdout.readline()))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.connector.close()
        self.owner.stdin.close()
        self.owner.wait(30)

    def time(self, transfer_id: str, request: Request) -> float:
        import torch

        remote_ids, local_ids = request
        started = time.perf_counter()
        self.connector.start_read(transfer_id, self.peer, remote_ids, local_ids, deadline_s=60.0)
        outcome: dict[str, str] = {}
        while not outcome:
            outcome = self.connector.poll()
        seconds = time.perf_counter() - started
        if outcome[transfer_id] != "done":
            raise BenchError(f"{transfer_id}: {outcome[transfer_id]}")
        if not torch.equal(self.pool[local_ids], self.expected[remote_ids]):
            raise BenchError(f"{transfer_id} returned other bytes than the owner's blocks")
        return seconds


def seeded_pool(layout: Layout, seed: int):
    import torch

    return torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed))


def _compat(layout: Layout) -> str:
    from tandem.interfaces import compat_hash

    return compat_hash(model="bench-kv-transfer", dtype="float32", num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                       block_size=layout.block_size)


def _serve_pool(name: str, layout: Layout, seed: int) -> None:
    """The owner process: registers ``seeded_pool``, prints its handshake as one JSON line, then
    drains notifications until its stdin closes."""
    from tandem.interfaces import KVPoolDescriptor
    from tandem.plugin_manager import get_registry

    pool = seeded_pool(layout, seed)
    connector = get_registry().get("kv_connector", name)()
    connector.register_pool(pool, KVPoolDescriptor.for_pool(pool, _compat(layout)))
    print(json.dumps(connector.handshake_info()), flush=True)
    while not select.select([sys.stdin], [], [], 0.05)[0] or sys.stdin.read(1):
        connector.get_notifications()
    connector.close()


if __name__ == "__main__":
    _, flag, connector_name, spec = sys.argv
    assert flag == "--serve-pool"
    *dims, pool_seed = json.loads(spec)
    _serve_pool(connector_name, Layout(*dims), pool_seed)
