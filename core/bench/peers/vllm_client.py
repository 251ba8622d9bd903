"""vLLM's own load generator, ``vllm bench serve``, as the client of ``tandem bench serve``
(``--client vllm``): against tandem's server, vLLM's, or both with ``--baseline vllm``.

It runs in vLLM's venv (``--vllm-python``, through ``vllm_cli.py``) against the server's
``/v1/completions`` with vLLM's ``random`` dataset, streamed, ``ignore_eos`` (so every request
produces its output length), and writes its result JSON, which is read back into the summary
shape of ``tandem.bench.serve`` (output tok/s and the TTFT / TPOT / ITL / end-to-end medians,
means and p99), so that the report and the ratios print the same way whichever client ran.

Lengths: tandem's ``--prompt-len MIN MAX`` / ``--output-len MIN MAX`` become vLLM's length
``(MIN + MAX) / 2`` with ``--random-range-ratio (MAX - MIN) / (MAX + MIN)`` (vLLM draws uniformly
from ``[len·(1 − r), len·(1 + r)]``; one ratio serves both, so the two ranges must be
proportionate, or one of them fixed, else the command says so). ``--dataset`` files are
tandem's own format and are not handed to vLLM's client.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from tandem.bench.checkpoint import hf_folder
from tandem.bench.peers import peer_env, vllm_cli
from tandem.config import ConfigError

STAT_KEYS = {"ttft_ms": "ttft_ms", "tpot_ms": "tpot_ms", "itl_ms": "itl_ms", "e2e_ms": "e2el_ms"}


def lengths(prompt_len: tuple[int, int], output_len: tuple[int, int]) -> tuple[int, int, float]:
    """(input length, output length, range ratio) for vLLM's random dataset."""
    ratios = {round((hi - lo) / (hi + lo), 6) for lo, hi in (prompt_len, output_len) if hi != lo}
    if len(ratios) > 1:
        raise ConfigError("--client vllm draws prompt and output lengths with one range ratio: give "
                          "proportionate --prompt-len and --output-len ranges, or fix one of them "
                          f"(got {list(prompt_len)} and {list(output_len)})")
    ratio = ratios.pop() if ratios else 0.0
    return (sum(prompt_len) // 2, sum(output_len) // 2, ratio)


def command(args: argparse.Namespace, url: str, model_name: str, tokenizer: str, result: Path) -> list[str]:
    input_len, output_len, ratio = lengths(tuple(args.prompt_len), tuple(args.output_len))
    cmd = [args.vllm_python, vllm_cli.__file__, "bench", "serve", "--backend", "openai",
           "--base-url", url, "--endpoint", "/v1/completions", "--model", model_name,
           "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", str(ratio), "--num-prompts", str(args.num_prompts or 32),
           "--request-rate", str(args.request_rate), "--seed", str(args.seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    return cmd


def summary_of(raw: dict) -> dict:
    """vLLM's result JSON in ``tandem.bench.serve.summarize``'s shape (the keys it has)."""
    out = {
        "completed": raw["completed"],
        "failed": raw.get("failed", raw.get("num_prompts", raw["completed"]) - raw["completed"]),
        "duration_s": raw["duration"],
        "total_input_tokens": raw["total_input_tokens"],
        "total_output_tokens": raw["total_output_tokens"],
        "request_throughput": raw["request_throughput"],
        "output_throughput": raw["output_throughput"],
        "total_token_throughput": raw.get("total_token_throughput",
                                          (raw["total_input_tokens"] + raw["total_output_tokens"]) / raw["duration"]),
        "errors": [e for e in raw.get("errors", []) if e][:5],
    }
    for ours, theirs in STAT_KEYS.items():
        out[ours] = {"mean": raw[f"mean_{theirs}"], "p50": raw[f"median_{theirs}"],
                     **{f"p{p}": raw[f"p{p}_{theirs}"] for p in (90, 99) if f"p{p}_{theirs}" in raw}}
    return out


def bench(args: argparse.Namespace, url: str, model_name: str, tokenizer: str) -> dict | None:
    """Run ``vllm bench serve`` against ``url``; its own report streams to the terminal."""
    if not args.vllm_python:
        raise ConfigError("--client vllm needs --vllm-python PATH (scripts/make_vllm_venv.sh builds "
                          ".venv-vllm; then .venv-vllm/bin/python)")
    if args.dataset:
        raise ConfigError("--client vllm uses vLLM's random dataset: not with --dataset")
    if args.plot or args.result_json:
        raise ConfigError("--plot and --result-json need tandem's client (per-request results)")
    with tempfile.TemporaryDirectory(prefix="tandem-vllm-bench-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = command(args, url, model_name, hf_folder(tokenizer), result)
        print(f"vllm bench serve: {' '.join(cmd[2:])}", flush=True)
        if subprocess.run(cmd, env=peer_env()).returncode != 0 or not result.is_file():
            print("tandem bench serve: vllm bench serve failed (its output is above)")
            return None
        return summary_of(json.loads(result.read_text()))
