"""Time tandem's CPU linear kernels against each other on chosen shapes and row counts: each kind's
median over repeated calls of ``PackedLinear`` (the packed weight ``engine.cpu_kernels`` would use),
and the GFLOP/s it implies. Weights of a few MB stay in cache between calls; larger ones (an LM
head) stream from memory, as all do with ``--stream``.

    python examples/linear_bench.py --dtype float32 --shapes 3072x576 576x1536 --rows 16 64 2048
    python examples/linear_bench.py --dtype bfloat16 --kinds dpbf16 onednn
    python examples/linear_bench.py --dtype bfloat16 --kinds dpbf16 amx onednn --rows 1 16 64 --stream 512

Prints one line a shape and row count.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem.models.cpu_linear import PAIR_KINDS, PackedLinear, available_kinds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--shapes", nargs="+", default=["3072x576", "960x576", "576x1536", "576x576", "49152x576"],
                   help="N x K of the layers (default: SmolLM2-135M's)")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256, 2048])
    p.add_argument("--kinds", nargs="+", default=None,
                   help="kernels: tandem, dpbf16, amx, onednn, torch (default: every one this machine has but torch's)")
    p.add_argument("--stream", type=int, default=0, metavar="MIB",
                   help="cycle through copies of each weight filling this many MiB, so that each call reads its "
                        "weight from memory as a decode step does (default 0: one weight, cached between calls)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    kinds = args.kinds or [k for k in available_kinds() if k != "torch" and (k not in PAIR_KINDS or dtype == torch.bfloat16)]
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, generator=gen).to(dtype)
        copies = max(1, (args.stream << 20) // w.nbytes)
        packed = {kind: [PackedLinear.pack(kind, w) for _ in range(copies)] for kind in kinds}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dtype)
            calls = max(5, int(3e8 / (m * n * k)))
            line = []
            for kind, linears in packed.items():
                for i in range(3):
                    linears[i % copies](x)
                times = []
                for i in range(calls):
                    start = time.perf_counter()
                    linears[i % copies](x)
                    times.append(time.perf_counter() - start)
                median = statistics.median(times)
                line.append(f"{kind} {median * 1e6:8.0f} us {2 * m * n * k / median / 1e9:5.0f} GFLOP/s")
            print(f"{args.dtype} {n}x{k} M={m}: " + "   ".join(line), flush=True)


if __name__ == "__main__":
    main()
