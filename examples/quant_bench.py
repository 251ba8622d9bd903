"""Weight bytes, offline tokens/s and greedy agreement with float32 of the quantization methods.

    python examples/quant_bench.py [--model PATH] [--requests 16] [--max-tokens 64] [--work-dir DIR]

The model (default: the ``bench-100m`` preset, built on first use) is quantized with
``tandem quantize`` into every format below (kept in --work-dir between runs). Each variant then
serves the same requests through ``tandem.LLM``: seeded random prompts of 16–64 tokens, greedy,
EOS ignored, after a short warm-up. All variants stay loaded and are timed in turn, round after
round (--repeats rounds, the best run counts), so that a load swing on a shared machine hits them
alike. The table gives, per variant, the
bytes of its weights in memory (the linear layers' alone, and the whole model's), tokens/s, and
how its output agrees with float32's:

- ``identical``: the share of requests whose greedy output is float32's, token for token;
- ``prefix``: the mean share of each request's tokens before its first difference;
- ``top-1``: teacher-forced next-token agreement — fed float32's prompt + output, the share of
  output positions where the variant's most likely token (``prompt_logprobs``) is float32's.

A random-weight model such as bench-100m amplifies small weight errors through its layers, so
its free-running agreement (identical, prefix) is far below a trained model's; top-1 isolates
each step's error.
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
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; each variant's best run counts")
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
    for name, p in llm.engine.executor.worker.model.named_parameters():
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


def load_variant(path: Path, requests: list[list[int]], max_tokens: int) -> LLM:
    blocks = len(requests) * -(-(max(map(len, requests)) + max_tokens) // 16) + 16
    llm = LLM(model=str(path), max_num_seqs=len(requests), num_kv_blocks=blocks)
    llm.generate(requests[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    return llm


def timed_run(llm: LLM, requests: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, greedy outputs) of one run over every request."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate(requests, params)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outputs]


def teacher_forced_top1(llm: LLM, requests: list[list[int]], reference: list[list[int]]) -> float:
    """Share of reference output positions where ``llm``'s most likely next token is the reference's."""
    full = [p + r for p, r in zip(requests, reference)]
    outs = llm.generate(full, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    hits = total = 0
    for prompt, ref, out in zip(requests, reference, outs):
        for i, token in enumerate(ref, start=len(prompt)):
            top = min(out.prompt_logprobs[i].items(), key=lambda item: item[1].rank)[0]
            hits += top == token
            total += 1
    return hits / total


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
    names = ["fp32"] + [v for v in args.variants if v != "fp32"]
    paths, quantize_s = {}, {}
    for name in names:
        paths[name], quantize_s[name] = variant_path(src, work_dir, name)
    requests = prompts(vocab_size(src), args.requests)
    llms = {name: load_variant(paths[name], requests, args.max_tokens) for name in names}
    best = dict.fromkeys(names, float("inf"))
    outputs = {}
    for _ in range(args.repeats):
        for name in names:
            seconds, outputs[name] = timed_run(llms[name], requests, args.max_tokens)
            best[name] = min(best[name], seconds)
    rows = []
    for name in names:
        linear, total = weight_bytes(llms[name])
        identical, prefix = agreement(outputs[name], outputs["fp32"])
        top1 = teacher_forced_top1(llms[name], requests, outputs["fp32"])
        tokens_per_s = args.requests * args.max_tokens / best[name]
        rows.append((name, linear, total, tokens_per_s, identical, prefix, top1, quantize_s[name]))
    print(f"{args.requests} requests x {args.max_tokens} tokens, greedy, on {src}")
    print(f"{'variant':<16} {'linear MiB':>10} {'total MiB':>10} {'tok/s':>8} {'identical':>9} "
          f"{'prefix':>7} {'top-1':>6} {'quantize s':>10}")
    for name, linear, total, tps, identical, prefix, top1, qs in rows:
        print(f"{name:<16} {linear / 2**20:>10.1f} {total / 2**20:>10.1f} {tps:>8.1f} {identical:>9.0%} "
              f"{prefix:>7.0%} {top1:>6.1%} {qs:>10.1f}")

if __name__ == "__main__":
    main()
