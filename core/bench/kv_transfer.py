"""`tandem bench kv-transfer`: the KV hand-over of one realistic request through a KV connector,
against an in-process torch copy of the same scattered blocks, in one run.

Layout (the defaults): bench-100m's KV pool, ``[num_blocks, 8 layers, K/V, 16 tokens, 4 KV heads,
64]`` float32, so one block is 8 * 2 * 16 * 4 * 64 * 4 bytes = 256 KiB. The request: 2,000 prompt
tokens = 125 blocks, at random ids of a pool that another process (spawned here) owns, read into
other random ids of this process's pool; the clock runs from ``start_read`` until ``poll`` reports
"done". The baseline copies the same scattered blocks between two pools of the same layout in this
process, one ``copy_`` per block (the fastest torch way measured: ``index_select`` + ``index_copy_``
copies twice and took 1.8× as long). Each runs ``--repeats`` times after ``--warmup``
rounds; the medians are compared (target: the connector reaches at least 50% of the copy).
"""
from __future__ import annotations

import argparse
import json
import random
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

TARGET_RATIO = 0.5


@dataclass(frozen=True, slots=True)
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
    mib = num_blocks * layout.block_bytes / 2**20
    print(f"KV hand-over: {num_blocks} scattered blocks ({args.prompt_tokens} tokens) of "
          f"{layout.block_bytes // 1024} KiB = {mib:.1f} MiB; median of {args.repeats} rounds after "
          f"{args.warmup} warm-up", flush=True)
    copy_s = statistics.median(time_torch_copy(layout, requests)[args.warmup:])
    transfer_times = time_connector(args.connector, layout, requests, args.seed)
    if transfer_times is None:
        return 1
    transfer_s = statistics.median(transfer_times[args.warmup:])
    nbytes = num_blocks * layout.block_bytes
    print(f"  torch copy, in-process      {copy_s * 1e3:8.2f} ms  {nbytes / copy_s / 2**30:6.2f} GiB/s")
    print(f"  {args.connector} read, other process {transfer_s * 1e3:8.2f} ms  "
          f"{nbytes / transfer_s / 2**30:6.2f} GiB/s  (bytes verified)")
    ratio = copy_s / transfer_s
    verdict = "met" if ratio >= TARGET_RATIO else "missed"
    print(f"  {args.connector} / torch copy: {ratio:.0%} (target ≥ {TARGET_RATIO:.0%}: {verdict})")
    return 0


def time_torch_copy(layout: Layout, requests: list[Request]) -> list[float]:
    """Seconds per request of copying its blocks between two pools of this process."""
    import torch

    src = torch.randn(layout.shape)
    dst = torch.zeros(layout.shape)
    times = []
    for remote_ids, local_ids in requests:
        started = time.perf_counter()
        for remote_id, local_id in zip(remote_ids, local_ids):
            dst[local_id].copy_(src[remote_id])
        times.append(time.perf_counter() - started)
    assert torch.equal(dst[local_ids], src[remote_ids])
    return times


def time_connector(name: str, layout: Layout, requests: list[Request], seed: int) -> list[float] | None:
    """Seconds per request of reading its blocks through connector ``name`` from an owner process
    started here; None (after saying why) when a read fails or returns bytes that are not the
    owner's (its pool is ``seeded_pool(layout, seed)``)."""
    import torch

    from tandem.interfaces import KVPoolDescriptor
    from tandem.plugin_manager import get_registry

    owner = subprocess.Popen(
        [sys.executable, "-m", "tandem.bench.kv_transfer", "--serve-pool", name, json.dumps(
            [layout.num_blocks, layout.num_layers, layout.block_size, layout.num_kv_heads,
             layout.head_dim, seed])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pool = torch.zeros(layout.shape)
    expected = seeded_pool(layout, seed)
    connector = get_registry().get("kv_connector", name)()
    try:
        connector.register_pool(pool, KVPoolDescriptor.for_pool(pool, _compat(layout)))
        peer = connector.add_peer(json.loads(owner.stdout.readline()))
        times = []
        for i, (remote_ids, local_ids) in enumerate(requests):
            started = time.perf_counter()
            connector.start_read(f"bench-{i}", peer, remote_ids, local_ids, deadline_s=60.0)
            outcome: dict[str, str] = {}
            while not outcome:
                outcome = connector.poll()
            times.append(time.perf_counter() - started)
            if outcome[f"bench-{i}"] != "done":
                print(f"read {i} failed: {outcome[f'bench-{i}']}")
                return None
            if not torch.equal(pool[local_ids], expected[remote_ids]):
                print(f"read {i} returned other bytes than the owner's blocks")
                return None
        return times
    finally:
        connector.close()
        owner.stdin.close()
        owner.wait(30)


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
