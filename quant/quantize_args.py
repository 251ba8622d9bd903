"""The ``tandem quantize`` command line: its arguments and their allowed values, without torch, so
that building the CLI's parser (``tandem --help``, ``tandem --version``) imports nothing heavy;
``tandem.quant.quantize`` does the work."""
from __future__ import annotations

import argparse

METHODS = ("gptq", "awq", "fp8")
FP8_GRANULARITIES = ("tensor", "channel", "block")
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}
"""GPTQ's checkpoint formats → the offset its stored zero points carry (``gptq``: zeros minus one)."""
DEFAULT_SHARD_BYTES = 4 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="Hugging Face model folder (safetensors weights)")
    parser.add_argument("dst", metavar="DST", help="folder to write the quantized copy into")
    parser.add_argument("--method", choices=METHODS, required=True, help="checkpoint format to write")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4, help="GPTQ: 4 or 8 (AWQ: 4) [4]")
    parser.add_argument("--group-size", type=int, default=128,
                        help="GPTQ/AWQ: inputs per scale group; -1 = one group per row (GPTQ) [128]")
    parser.add_argument("--sym", action=argparse.BooleanOptionalAction, default=None,
                        help="GPTQ/AWQ: symmetric (--sym) or asymmetric (--no-sym) zero points "
                             "[GPTQ: sym, AWQ: asym]")
    parser.add_argument("--checkpoint-format", choices=tuple(CHECKPOINT_FORMATS), default="gptq",
                        help="GPTQ: 'gptq' (zeros stored minus one; a zero point of 0 is clamped to 1) "
                             "or 'gptq_v2' [gptq]")
    parser.add_argument("--fp8-scales", choices=FP8_GRANULARITIES, default="block",
                        help="FP8: one scale per tensor, per output channel, or per block [block]")
    parser.add_argument("--block-size", type=int, default=128, help="FP8: block edge for --fp8-scales block [128]")
    parser.add_argument("--max-shard-size", type=int, default=DEFAULT_SHARD_BYTES, metavar="BYTES",
                        help=f"largest safetensors file [{DEFAULT_SHARD_BYTES}]")
