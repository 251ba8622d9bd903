"""``tandem bench serve --client vllm``: the ``vllm bench serve`` command it builds and how it reads
vLLM's result file back (a result of vLLM's format written out by hand); no vLLM runs here."""
from __future__ import annotations

import argparse

import pytest

from tandem.bench import serve
from tandem.bench.peers import vllm_client, vllm_serve
from tandem.config import ConfigError


def parse(*argv):
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    vllm_serve.add_arguments(p)
    return p.parse_args(list(argv))


def test_lengths_become_a_mid_length_and_one_range_ratio():
    assert vllm_client.lengths((128, 128), (128, 128)) == (128, 128, 0.0)
    assert vllm_client.lengths((16, 256), (128, 128)) == (136, 128, pytest.approx(240 / 272))
    assert vllm_client.lengths((100, 300), (50, 150)) == (200, 100, 0.5)
    with pytest.raises(ConfigError, match="proportionate"):
        vllm_client.lengths((16, 256), (64, 128))


def test_the_command_drives_the_server_like_tandems_client(tmp_path):
    args = parse("--client", "vllm", "--vllm-python", "/venv/bin/python", "--num-prompts", "64",
                 "--prompt-len", "128", "128", "--output-len", "128", "128", "--max-concurrency", "16",
                 "--seed", "3")
    cmd = vllm_client.command(args, "http://127.0.0.1:9000", "m", "/models/m", tmp_path / "r.json")
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("vllm_cli.py") and cmd[2:4] == ["bench", "serve"]
    opts = dict(zip(cmd[4::1], cmd[5::1]))
    assert opts["--base-url"] == "http://127.0.0.1:9000" and opts["--endpoint"] == "/v1/completions"
    assert opts["--dataset-name"] == "random" and opts["--random-input-len"] == "128"
    assert opts["--random-output-len"] == "128" and opts["--num-prompts"] == "64"
    assert opts["--max-concurrency"] == "16" and opts["--seed"] == "3" and opts["--tokenizer"] == "/models/m"
    assert "--ignore-eos" in cmd and opts["--result-filename"] == "r.json"


def test_vllm_results_read_into_the_report_shape():
    raw = {"completed": 63, "num_prompts": 64, "duration": 40.0, "total_input_tokens": 8064,
           "total_output_tokens": 8064, "request_throughput": 1.575, "output_throughput": 201.6,
           "total_token_throughput": 403.2, "errors": ["", "boom"]}
    for name in ("ttft", "tpot", "itl", "e2el"):
        raw.update({f"mean_{name}_ms": 10.0, f"median_{name}_ms": 9.0, f"p90_{name}_ms": 20.0,
                    f"p99_{name}_ms": 30.0})
    summary = vllm_client.summary_of(raw)
    assert summary["failed"] == 1 and summary["errors"] == ["boom"]
    assert summary["tpot_ms"] == {"mean": 10.0, "p50": 9.0, "p90": 20.0, "p99": 30.0}
    report = serve.format_report(summary)  # the same report tandem's client prints
    assert "201.60" in report and "End-to-end Latency" in report


def test_refusals_name_what_is_missing():
    with pytest.raises(ConfigError, match="--vllm-python"):
        vllm_client.bench(parse("--client", "vllm"), "http://x", "m", "/m")
    with pytest.raises(ConfigError, match="--dataset"):
        vllm_client.bench(parse("--client", "vllm", "--vllm-python", "p", "--dataset", "f.jsonl"),
                          "http://x", "m", "/m")
