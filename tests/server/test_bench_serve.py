"""A smoke run of `tandem bench serve` against a tiny model: against a running server (--url)
and with its own server (--model) on a JSONL dataset with Poisson arrivals.

Oracles: the server's own /metrics counters (tokens generated, requests finished), HF's
tokenizer for prompt lengths, and the lengths written in the dataset."""
from __future__ import annotations

import argparse
import json

import pytest
from transformers import AutoTokenizer

from tandem.bench.serve import add_arguments, run
from tests.server.server_helpers import scrape


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_against_a_running_server(server, model_dir, tmp_path, capsys):
    generated_before = scrape(server.url)["tandem:generation_tokens_total"]
    result = tmp_path / "result.json"
    png = tmp_path / "latency.png"
    status = run(_args(
        "--url", server.url, "--model", str(model_dir), "--num-prompts", "6", "--prompt-len", "4", "12",
        "--output-len", "5", "8", "--max-concurrency", "3", "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
        "--result-json", str(result), "--plot", str(png)))
    assert status == 0
    summary = json.loads(result.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    warmup_tokens = 2
    generated = scrape(server.url)["tandem:generation_tokens_total"] - generated_before
    assert summary["total_output_tokens"] == generated - warmup_tokens
    assert 6 * 5 <= summary["total_output_tokens"] <= 6 * 8
    throughput = summary["total_output_tokens"] / summary["duration_s"]
    assert summary["output_throughput"] == pytest.approx(throughput)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert summary["e2e_ms"]["p99"] >= summary["ttft_ms"]["p99"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = capsys.readouterr().out
    for line in ("Request throughput", "Output token throughput", "Time to First Token",
                 "Inter-token Latency", "P99 (ms)", "Goodput"):
        assert line in report


@pytest.mark.timeout(240)
def test_bench_starts_its_own_server_on_a_dataset(model_dir, tmp_path):
    dataset = tmp_path / "requests.jsonl"
    lines = [{"prompt": "def main():", "output_len": 4}, {"prompt_len": 20, "output_len": 6},
             {"prompt": "import os", "output_len": 3}]
    dataset.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    result = tmp_path / "result.json"
    status = run(_args(
        "--model", str(model_dir), "--dataset", str(dataset), "--request-rate", "20",
        "--slo-ttft-ms", "0.001", "--server-args", "--num-kv-blocks 64 --max-num-seqs 4",
        "--result-json", str(result)))
    assert status == 0
    summary = json.loads(result.read_text())
    assert summary["completed"] == 3
    assert summary["total_output_tokens"] == 4 + 6 + 3
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_tokens = len(tokenizer("def main():")["input_ids"]) + 20 + len(tokenizer("import os")["input_ids"])
    assert summary["total_input_tokens"] == prompt_tokens
    assert summary["goodput"] == 0.0, "no request meets a 1 µs TTFT"


@pytest.mark.timeout(240)
def test_bench_starts_its_own_server_on_a_gguf_file(tmp_path):
    """``--model`` takes a .gguf file: its vocabulary for the random prompts comes from the file's
    metadata and the server it starts loads the file."""
    from gguf import GGMLQuantizationType as Q

    from tests.helpers.gguf_files import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "llama.gguf", "llama", lambda name, i: Q.Q8_0)
    result = tmp_path / "result.json"
    status = run(_args(
        "--model", str(path), "--num-prompts", "4", "--prompt-len", "6", "10", "--output-len", "3", "5",
        "--max-concurrency", "2", "--server-args", "--num-kv-blocks 64 --max-num-seqs 4",
        "--result-json", str(result)))
    assert status == 0
    summary = json.loads(result.read_text())
    assert summary["completed"] == 4 and summary["failed"] == 0
    assert 4 * 3 <= summary["total_output_tokens"] <= 4 * 5
    assert 4 * 6 <= summary["total_input_tokens"] <= 4 * 10
