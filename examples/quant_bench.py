"""Weight bytes, offline tokens/s and greedy agreement with float32 of the quantization methods.

    python examples/quant_bench.py [--model PATH] [--requests 16] [--max-tokens 64] [--work-dir DIR]

The model (default: the ``bench-100m`` preset, built on first use) is quantized with
``tandem quantize`` into every format below (kept in --work-dir between runs). Each variant then
serves the same requests through ``tandem.LLM``: seeded random prompts of 16–64 tokens, greedy,
EOS ignored, after a short warm-up. The table gives, per variant, the bytes of its weights in
memory (the linear layers' alone, and the whole model's), tokens/s, and how its greedy output
agrees with float32's: the share of requests that are identical, and the mean share of each
request's tokens before its first difference.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from tandem import LLM, SamplingParams
from tandem.cli import main as tandem_main

VARIANTS = {
    "fp32": None,
    "gptq-int4-g128": ["--method", "gptq", "--bits", "4", "--group-size", "128"],
    "gptq-int8-g128": ["--method", "gptq", "--bits", "8", "--group-size", "128"],
    "awq-int4-g128": ["--method", "awq", "--group-size", "128"],
    "fp8-block128": ["--method", "fp8", "--fp8-scales", "block", "--block-size", "128"],
    "fp8-channel": ["--method", "fp8", "--fp8-scales", "channel"],
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model folder (default: the bench-100m preset)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "tandem-quant-bench"))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    return parser.parse_args()


def model_path(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from tandem.models.presets import default_model_path

    return Path(default_model_path("bench-100m"))


def variant_path(src: Path, work_dir: Path, name: str) -> tuple[Path, float]:
    """The folder of variant ``name`` (quantized now unless already there) and the seconds spent."""
    if VARIANTS[name] is None:
        return src, 0.0
    dst = work_dir / name
    if (dst / "config.json").exists():
        return dst, 0.0
    t0 = time.perf_counter()
    if tandem_main(["--log-level", "WARNING", "quantize", str(src), str(dst), *VARIANTS[name]]) != 0:
        raise SystemExit(f"quantizing {name} failed")
    return dst, time.perf_counter() - t0


def weight_bytes(llm: LLM) -> tuple[int, int]:
    """(bytes of the linear layers' parameters, bytes of every parameter)."""
    linear = total = 0
    for name, p in llm.engine.model.named_parameters():
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if "_proj." in name:
            linear += nbytes
    return linear, total


def vocab_size(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def prompts(vocab_size: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(16, 64))] for _ in range(count)]


def run_variant(path: Path, requests: list[list[int]], max_tokens: int) -> tuple[LLM, float, list[list[int]]]:
    llm = LLM(model=str(path), max_num_seqs=len(requests))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(requests[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    outputs = llm.generate(requests, params)
    seconds = time.perf_counter() - t0
    return llm, len(requests) * max_tokens / seconds, [o.outputs[0].token_ids for o in outputs]


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of identical requests, mean share of tokens before the first difference)."""
    identical = sum(a == b for a, b in zip(outputs, reference)) / len(reference)
    prefixes = []
    for a, b in zip(outputs, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        prefixes.append(same / len(b))
    return identical, sum(prefixes) / len(prefixes)


def main() -> None:
    args = parse_args()
    src = model_path(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    reference = None
    rows = []
    for name in ["fp32"] + [v for v in args.variants if v != "fp32"]:
        path, quantize_s = variant_path(src, work_dir, name)
        llm, tokens_per_s, outputs = run_variant(path, prompts(vocab_size(path), args.requests), args.max_tokens)
        linear, total = weight_bytes(llm)
        reference = reference or outputs
        identical, prefix = agreement(outputs, reference)
        rows.append((name, linear, total, tokens_per_s, identical, prefix, quantize_s))
        del llm
    print(f"{args.requests} requests x {args.max_tokens} tokens, greedy, on {src}")
    print(f"{'variant':<16} {'linear MiB':>10} {'total MiB':>10} {'tok/s':>8} {'identical':>9} "
          f"{'prefix':>7} {'quantize s':>10}")
    for name, linear, total, tps, identical, prefix, qs in rows:
        print(f"{name:<16} {linear / 2**20:>10.1f} {total / 2**20:>10.1f} {tps:>8.1f} {identical:>9.0%} "
              f"{prefix:>7.0%} {qs:>10.1f}")


if __name__ == "__main__":
    main()
