"""A smoke run of `tandem bench serve` against a tiny model: against a running server (--url)
and with its own server (--model) on a JSONL dataset with Poisson arrivals.

Oracles: the server's own /metrics counters (tokens generated, requests finished), HF's
tokenizer for prompt lengths, and the lengths written in the dataset."""
from __future__ import annotations

import argparse
import json
import math

import pytest
from transformers import AutoTokenizer

from tandem.bench.serve import RequestResult, add_arguments, run, summarize
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
        "--output-len", "150", "200", "--max-concurrency", "3", "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
        "--result-json", str(result), "--plot", str(png)))
    assert status == 0
    summary = json.loads(result.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    warmup_tokens = 2
    generated = scrape(server.url)["tandem:generation_tokens_total"] - generated_before
    assert summary["total_output_tokens"] == generated - warmup_tokens
    assert 6 * 150 <= summary["total_output_tokens"] <= 6 * 200
    throughput = summary["total_output_tokens"] / summary["duration_s"]
    assert summary["output_throughput"] == pytest.approx(throughput)
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    # answers long enough to stream in several chunks (the server sends whatever tokens are ready
    # when it writes: a short answer from the tiny model can come in one, and has no ITL)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert summary["e2e_ms"]["p99"] >= summary["ttft_ms"]["p99"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = capsys.readouterr().out
    for line in ("Request throughput", "Output token throughput", "Time to First Token",
                 "Inter-token Latency", "P99 (ms)", "Goodput"):
        assert line in report


def test_summary_of_hand_made_results():
    """Percentiles as numpy's linear interpolation gives them by hand: ITL over every gap of
    every answer, TPOT from e2e and TTFT, a failed request counted but left out of the rest."""
    results = [
        RequestResult(ok=True, prompt_tokens=3, output_tokens=3, ttft_s=0.1, e2e_s=0.3, itl_s=[0.1, 0.1]),
        RequestResult(ok=True, prompt_tokens=5, output_tokens=5, ttft_s=0.2, e2e_s=0.6,
                      itl_s=[0.1, 0.3]),  # two chunks of two tokens after the first
        RequestResult(ok=True, prompt_tokens=2, output_tokens=4, ttft_s=0.3, e2e_s=0.3),  # one chunk
        RequestResult(ok=False, error="HTTP 400: b'bad'"),
    ]
    summary = summarize(results, duration_s=2.0, slo_ttft_ms=250, slo_tpot_ms=150)
    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (10, 12)
    assert summary["output_throughput"] == pytest.approx(6.0)
    # gaps 100, 100, 100, 300 ms: p50 = 100, p90 = 100 + 0.7 * 200, p99 = 100 + 0.97 * 200
    assert summary["itl_ms"]["p50"] == pytest.approx(100)
    assert summary["itl_ms"]["p90"] == pytest.approx(240)
    assert summary["itl_ms"]["p99"] == pytest.approx(294)
    assert summary["itl_ms"]["mean"] == pytest.approx(150)
    # TPOT: 100, 100 and 0 ms; the third answer came in one chunk
    assert summary["tpot_ms"]["mean"] == pytest.approx(200 / 3)
    assert summary["goodput"] == pytest.approx(2 / 2.0), "the first two meet TTFT <= 250 ms, TPOT <= 150"
    assert summary["errors"] == ["HTTP 400: b'bad'"]
    alone = summarize(results[2:3], duration_s=1.0)
    assert all(math.isnan(v) for v in alone["itl_ms"].values())


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
