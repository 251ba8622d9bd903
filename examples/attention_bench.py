"""Time one layer of tandem's CPU decode attention (``cpu_ops.paged_decode``) on a model's head
layout: ``rows`` one-query rows of ``context`` keys each, their blocks scattered over a pool as a
running engine's are. ``--pools 4`` rotates four pools, so the KV comes from memory as it does
when 30 layers' KV pass through the caches in a step; ``--pools 1`` times it from cache.

    python examples/attention_bench.py --rows 64 --context 150 --pools 4
    python examples/attention_bench.py --heads 9 --kv-heads 3 --head-dim 64 --dtype float32

Prints the median time a call and the KV read rate it implies.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.kernels import cpu_ops
from tandem.models import huge_pages

BLOCK_SIZE = 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--context", type=int, default=150)
    p.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2-135M: 9)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--pools", type=int, default=4, help="pools rotated between calls (1: KV in cache)")
    p.add_argument("--num-blocks", type=int, default=2912, help="blocks of each pool")
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args()
    if not cpu_ops.load():
        raise SystemExit("tandem's CPU kernels could not be built here")
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    shape = (args.num_blocks, 2, BLOCK_SIZE, args.kv_heads, args.head_dim)
    # on 2 MiB pages where the system gives them, as the engine's pool is (scattered blocks on
    # 4 KiB pages would time TLB misses the engine does not have)
    pools = [huge_pages.HugePageArena().copy(torch.randn(shape, generator=gen).to(dtype)) for _ in range(args.pools)]
    blocks = -(-args.context // BLOCK_SIZE)
    tables = torch.randperm(args.num_blocks, generator=gen)[: args.rows * blocks].view(args.rows, blocks).contiguous()
    q = torch.randn(args.rows, args.heads, args.head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    rows = torch.arange(args.rows)
    lens = torch.full((args.rows,), args.context, dtype=torch.long)
    times = []
    for call in range(args.calls + 4):
        start = time.perf_counter()
        cpu_ops.paged_decode(out, q, pools[call % args.pools], rows, tables, lens, args.head_dim**-0.5, 0)
        if call >= 4:  # the first calls warm up
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    kv_bytes = args.rows * args.context * 2 * args.kv_heads * args.head_dim * q.element_size()
    print(f"{args.rows} rows x {args.context} keys, {args.heads}/{args.kv_heads} heads of {args.head_dim}, "
          f"{args.dtype}, {args.pools} pool(s), {torch.get_num_threads()} threads: "
          f"{median * 1e6:.0f} us a call, KV read at {kv_bytes / median / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
