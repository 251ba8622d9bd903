"""`tandem bench offline --baseline vllm` without vLLM: the workload and result files cross between
tandem's side and the driver's intact, and a baseline that cannot run is a usage error naming the
flag before anything loads. vLLM itself never runs here (minutes per run; it lives in its own venv)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.bench.peers import vllm_offline_driver as driver
from tandem.bench.peers.vllm_offline import read_result, write_workload
from tandem.bench.peers.vllm_serve import format_median_ratios, format_ratios
from tandem.bench.workload import Workload, token_agreement
from tandem.cli import main


def test_workload_reaches_the_driver_intact(tmp_path):
    wl = Workload(prompts=[[5, 6, 7], [9] * 40], max_tokens=[16, 3])
    path = tmp_path / "workload.json"
    write_workload(path, wl, "/models/m", "bfloat16", max_num_seqs=64, max_num_batched_tokens=2048,
                   seed=3)
    assert driver.load_workload(str(path)) == {
        "model": "/models/m", "dtype": "bfloat16", "prompts": [[5, 6, 7], [9] * 40],
        "max_tokens": [16, 3], "max_num_seqs": 64, "max_num_batched_tokens": 2048, "seed": 3}


def test_driver_result_reads_back_as_a_mode(tmp_path):
    path = tmp_path / "result.json"
    driver.write_result(str(path), seconds=2.5, load_s=40.0, outputs=[[1, 2], [3]],
                        env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    result, extra = read_result(path)
    assert (result.mode, result.seconds, result.outputs) == ("vllm", 2.5, [[1, 2], [3]])
    assert result.tokens_per_s(Workload(prompts=[[0], [0]], max_tokens=[2, 3])) == 5 / 2.5
    assert extra == {"load_s": 40.0, "env": {"VLLM_CPU_KVCACHE_SPACE": "4"}}


def test_driver_rejects_a_workload_missing_a_key(tmp_path):
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"model": "m", "prompts": [[1]], "max_tokens": [1]}))
    with pytest.raises(ValueError, match="dtype, max_num_seqs, max_num_batched_tokens, seed"):
        driver.load_workload(str(path))


def test_token_agreement_counts_positions():
    # request 1: 3 of 4 tokens equal; request 2: none of 2 -> 3 of 6
    assert token_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 0, 4], [6, 5]]) == 0.5


def test_baseline_without_vllm_python_names_the_flag(capsys):
    assert main(["bench", "offline", "--model", "/nonexistent", "--baseline", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--baseline vllm needs --vllm-python PATH" in err, err


def test_vllm_python_without_vllm_names_the_flag(capsys):
    import sys

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this python has vllm")
    assert main(["bench", "offline", "--model", "/nonexistent", "--baseline", "vllm",
                 "--vllm-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert f"--vllm-python {sys.executable}: that python has no vllm" in err, err


def test_vllm_python_that_does_not_run_names_the_flag(tmp_path, capsys):
    missing = str(tmp_path / "no-python")
    assert main(["bench", "offline", "--model", "/nonexistent", "--baseline", "vllm",
                 "--vllm-python", missing]) == 2
    assert f"--vllm-python {missing}: cannot run it" in capsys.readouterr().err


def test_warmup_prompts_keep_lengths_but_not_prefixes():
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    assert driver.warmup_prompts(prompts) == [[3, 2, 1], [7, 6, 5, 4]]


def test_serve_baseline_without_vllm_python_names_the_flag(capsys):
    assert main(["bench", "serve", "--model", "/nonexistent", "--baseline", "vllm"]) == 2
    assert "--baseline vllm needs --vllm-python PATH" in capsys.readouterr().err


def test_serve_baseline_refuses_a_running_server(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--baseline", "vllm"]) == 2
    assert "give --model, not --url" in capsys.readouterr().err


def test_ratio_table_divides_tandem_by_vllm():
    ours = {"output_throughput": 300.0, "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 20.0},
            "e2e_ms": {"p50": 1000.0}}
    theirs = {"output_throughput": 600.0, "ttft_ms": {"p50": 100.0}, "tpot_ms": {"p50": 10.0},
              "e2e_ms": {"p50": 500.0}}
    table = format_ratios(ours, theirs)
    assert [line.split()[-1] for line in table.splitlines()[2:]] == ["0.50x", "0.50x", "2.00x", "2.00x"]


def test_median_ratio_table_takes_each_metrics_median_over_the_rounds():
    def summary(tok_s, ttft, tpot, e2e):
        return {"output_throughput": tok_s, "ttft_ms": {"p50": ttft}, "tpot_ms": {"p50": tpot},
                "e2e_ms": {"p50": e2e}}
    rounds = [(summary(300, 50, 20, 1000), summary(100, 100, 40, 500)),   # 3.0, 0.5, 0.5, 2.0
              (summary(200, 50, 30, 1000), summary(100, 25, 30, 1000)),   # 2.0, 2.0, 1.0, 1.0
              (summary(100, 10, 10, 1000), summary(100, 100, 20, 250))]   # 1.0, 0.1, 0.5, 4.0
    lines = format_median_ratios(rounds).splitlines()[2:]
    assert [line.split()[-2] for line in lines] == ["2.00x", "0.50x", "0.50x", "2.00x"]
    assert lines[0].split()[-1] == "(1.00-3.00x)"


def test_serve_baseline_refuses_one_server_outputs(capsys):
    assert main(["bench", "serve", "--model", "/nonexistent", "--baseline", "vllm",
                 "--result-json", "out.json"]) == 2
    assert "not with --baseline" in capsys.readouterr().err
