"""Which CPU linear kernel ``engine.cpu_kernels = "auto"`` measured fastest for each layer shape of a
model on this machine, and the times behind the choice (the fastest run of each kernel, µs).

    python examples/kernel_choice.py MODEL [--dtype bfloat16]

MODEL is anything ``tandem serve`` takes (a folder, a .gguf file). The first run on a machine
measures (unless other processes keep the CPUs busy; then run it again when they do not); later
runs read the cache.
"""
from __future__ import annotations

import argparse
import logging

from tandem import LLM
from tandem.models import cpu_tuning
from tandem.models.cpu_tuning import M_BUCKETS

KINDS = ("tandem", "dpbf16", "onednn", "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    LLM(model=args.model, dtype=args.dtype, cpu_kernels="auto", num_kv_blocks=16)
    key = cpu_tuning.machine_key()
    choices = cpu_tuning.read_cache(cpu_tuning.cache_path(key))
    print(f"\n{key['cpu']}, ISA {' '.join(key['isa'])}, {key['threads']} threads, torch {key['torch']}")
    print("| shape (dtype:N×K) | kernel per M = " + " / ".join(map(str, M_BUCKETS)) + " | "
          + " | ".join(f"{k} µs" for k in KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for shape, choice in sorted(choices.items()):
        if not shape.startswith(args.dtype):
            continue
        times = [" / ".join(f"{t * 1e6:.0f}" for t in choice.seconds.get(k, [])) or "–"
                 for k in KINDS]
        print(f"| {shape} | {' / '.join(choice.buckets)} | " + " | ".join(times) + " |")


if __name__ == "__main__":
    main()
