"""A smoke run of `tandem bench disagg` on the tiny Llama: both setups start, run a short
workload and stop, and the report holds both with finite numbers.

Oracles: the lengths the workload asks for (``ignore_eos``, so every steady request generates
exactly its output length and prompts are exactly their token counts), the router's own dispatch
counter (every request through it disaggregated), and the PNG file signature."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from tandem.bench.disagg import add_arguments, run
from tests.helpers.tiny_models import tiny_model_dir

pytest.importorskip("nixl_cu12", reason="the disaggregated setup's nixl KV connector needs nixl-cu12")

STREAMS, STREAM_PROMPT, STREAM_OUTPUT = 2, 8, 6
BURST_SIZE, BURST_PROMPT, BURST_OUTPUT = 2, 80, (1, 3)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.timeout(180)
def test_both_setups_run_the_workload_and_are_reported(tmp_path, capsys):
    result, png = tmp_path / "result.json", tmp_path / "disagg.png"
    status = run(_args(
        "--model", str(tiny_model_dir("llama")), "--duration-s", "3", "--streams", str(STREAMS),
        "--stream-prompt-len", str(STREAM_PROMPT), "--stream-output-len", str(STREAM_OUTPUT),
        "--burst-size", str(BURST_SIZE), "--burst-prompt-len", str(BURST_PROMPT),
        "--burst-output-len", *map(str, BURST_OUTPUT), "--burst-interval-s", "1",
        "--server-args", "--num-kv-blocks 64 --max-num-seqs 8",
        "--result-json", str(result), "--plot", str(png)))
    assert status == 0
    report = json.loads(result.read_text())
    for setup in ("colocated", "disaggregated"):
        steady, bursts = report[setup]["requests"]["steady"], report[setup]["requests"]["bursts"]
        assert len(steady) >= STREAMS and all(r["ok"] for r in steady + bursts)
        assert {(r["prompt_tokens"], r["output_tokens"]) for r in steady} == {(STREAM_PROMPT, STREAM_OUTPUT)}
        assert len(bursts) == 2 * BURST_SIZE, "bursts at t = 1 s and 2 s of a 3 s run"
        assert {r["prompt_tokens"] for r in bursts} == {BURST_PROMPT}
        assert all(BURST_OUTPUT[0] <= r["output_tokens"] <= BURST_OUTPUT[1] for r in bursts)
        for group, metric in (("all", "ttft_ms"), ("bursts", "ttft_ms"), ("steady", "tpot_ms")):
            stats = report[setup][group][metric]
            assert 0 < stats["p50"] <= stats["p99"] < math.inf
    assert report["colocated"]["torch_threads"] == 2 and report["disaggregated"]["torch_threads"] == 1
    total = len(report["disaggregated"]["requests"]["steady"]) + 2 * BURST_SIZE
    warmups = 2
    assert report["disaggregated"]["router_paths"]["disaggregated"] == total + warmups
    assert math.isfinite(report["tpot_p99_ratio"]) and report["tpot_p99_ratio"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    for line in ("TTFT, long prompts", "TPOT, steady streams", "p99 TPOT colocated / disaggregated"):
        assert line in table
