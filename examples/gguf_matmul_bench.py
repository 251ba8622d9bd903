"""Time of tandem's GGUF packed-block CPU kernel against dense linear layers on the same weights.

    python examples/gguf_matmul_bench.py [--repeats 200] [--threads N]

Shapes are SmolLM2-135M's (hidden 576, MLP 1536, vocabulary 49,152): 576 -> 1536 (gate/up),
1536 -> 576 (down) and the LM head 576 -> 49152, at M = 1 (decode) and M = 16 (a small batch or
prefill chunk). Each weight is random, quantized with ``gguf`` (Q4_1, Q8_0) or made of random
bytes with sane scales (Q4_K, which gguf cannot quantize; only on 1536 -> 576, the one shape whose
K is a multiple of its 256-value block), and timed as

- ``gguf``: ``cpu_ops.gguf_linear`` on the packed blocks (float32 x);
- ``bf16``, ``f32``: ``F.linear`` on the dequantized weight in that dtype (x in that dtype);
- ``panel-bf16``: tandem's dense panel kernel (``PackedLinear("tandem")``) on the bfloat16 weight.

All variants of one shape run interleaved, call after call, so a load swing on a shared machine
hits them alike; the table gives medians in microseconds and each one's ratio to ``gguf``.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from tandem.kernels import cpu_ops
from tandem.models.cpu_linear import PackedLinear

SHAPES = [("gate/up", 576, 1536), ("down", 1536, 576), ("lm_head", 576, 49152)]
TYPES = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0]


def packed_weight(ggml_type: GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes] blocks of a random weight."""
    if ggml_type != GGMLQuantizationType.Q4_K:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, ggml_type)
    elems, size = GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    raw[..., 0:4] = (rng.random((n, k // elems, 2)) * 1e-3).astype(np.float16).view(np.uint8)  # d, dmin
    return raw.reshape(n, -1)


def time_calls(calls: dict[str, callable], repeats: int) -> dict[str, float]:
    """Median microseconds of each call, the calls interleaved."""
    samples = {name: [] for name in calls}
    for name, call in calls.items():  # warm-up
        for _ in range(3):
            call()
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_ops.load():
        raise SystemExit("tandem's CPU kernels could not be built")
    rng = np.random.default_rng(0)
    print(f"threads={args.threads} cpu_capability={torch.backends.cpu.get_cpu_capability()}")
    print("| type | shape | M | gguf µs | bf16 µs | f32 µs | panel-bf16 µs | bf16/gguf | f32/gguf | panel/gguf |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ggml_type in TYPES:
        for label, k, n in SHAPES:
            if k % GGML_QUANT_SIZES[ggml_type][0]:
                continue
            blocks = packed_weight(ggml_type, n, k, rng)
            qweight = torch.from_numpy(blocks)
            w32 = torch.from_numpy(quants.dequantize(blocks, ggml_type).astype(np.float32))
            w16 = w32.bfloat16()
            panel = PackedLinear.pack("tandem", w16)
            for m in (1, 16):
                x = torch.randn(m, k)
                x16 = x.bfloat16()
                t = time_calls({
                    "gguf": lambda: cpu_ops.gguf_linear(x, qweight, int(ggml_type), k),
                    "bf16": lambda: F.linear(x16, w16),
                    "f32": lambda: F.linear(x, w32),
                    "panel": lambda: panel(x16),
                }, max(10, args.repeats if n < 10000 else args.repeats // 10))
                g = t["gguf"]
                print(f"| {ggml_type.name} | {label} {k}→{n} | {m} | {g:.0f} | {t['bf16']:.0f} | {t['f32']:.0f} | "
                      f"{t['panel']:.0f} | {t['bf16'] / g:.2f} | {t['f32'] / g:.2f} | {t['panel'] / g:.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
