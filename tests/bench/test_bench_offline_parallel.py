"""A smoke run of `tandem bench offline -tp 2` on the tiny Llama: both setups run the workload and
the report holds every figure. No timing is asserted (speed goals live in the benchmarks).

Oracle: tandem on one rank (the uniproc executor), whose greedy tokens the two-rank run must
repeat exactly."""
from __future__ import annotations

import argparse
import re

import pytest

from tandem.bench.offline import add_arguments, run
from tandem.config import ConfigError
from tests.helpers.tiny_models import tiny_model_dir

NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.timeout(120)
def test_tp2_run_reports_both_setups_the_channel_and_the_all_reduce(capsys):
    status = run(_args("--model", str(tiny_model_dir("llama")), "-tp", "2", "--num-requests", "3",
                       "--prompt-len", "4", "12", "--output-len", "3", "6", "--repeats", "1"))
    assert status == 0
    report = capsys.readouterr().out
    expected = [
        rf"^1 rank +{NUMBER} +{NUMBER} +[0-9]+$",
        rf"^tp=2 pp=1 +{NUMBER} +{NUMBER} +[0-9]+$",
        rf"^tp=2 pp=1 / 1 rank: {NUMBER}x tok/s$",
        rf"^channel \(step_seconds - worker_seconds\), median over [0-9]+ steps: {NUMBER} ms per step, "
        rf"-?{NUMBER}% of the step \(median step {NUMBER} ms, median slowest-rank compute {NUMBER} ms\)$",
        rf"^all-reduce inside the step .*: {NUMBER} us per call x 5 calls \+ logits gather of "
        rf"[0-9]+ rows \(median\) {NUMBER} us = {NUMBER} ms per step, {NUMBER}% of the median step$",
        r"^greedy agreement of tp=2 pp=1 with 1 rank: 100%$",
    ]
    for line in expected:
        assert re.search(line, report, re.MULTILINE), f"no line matching {line!r} in:\n{report}"


def test_modes_are_refused_with_tp():
    with pytest.raises(ConfigError, match="drop --modes"):
        run(_args("--model", str(tiny_model_dir("llama")), "-tp", "2", "--modes", "tandem"))
