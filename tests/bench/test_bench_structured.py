"""A smoke run of `tandem bench structured` on the tiny Llama: both kinds of request generate the
same number of tokens (the schema cannot complete within the limit, so the comparison is of
equal work) and the report holds every figure. No timing is asserted."""
from __future__ import annotations

import argparse
import re

import pytest

from tandem.bench.structured import add_arguments, run
from tests.helpers.tiny_models import tiny_model_dir

NUMBER = r"[0-9]+(?:\.[0-9]+)?"


@pytest.mark.timeout(300)
def test_report_compares_equal_work(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir("llama")), "--num-requests", "4",
                              "--prompt-len", "8", "--output-len", "24", "--rounds", "1"])
    assert run(args) == 0
    report = capsys.readouterr().out
    assert re.search(rf"^first compile of the JSON schema: {NUMBER} ms$", report, re.M), report
    for name in ("unconstrained", "json schema"):
        line = re.search(rf"^  {name} +{NUMBER} tok/s  \(([0-9]+) tokens per round; bitmask {NUMBER} ms per step\)$",
                         report, re.M)
        assert line is not None, report
        assert int(line.group(1)) == 4 * 24
    assert re.search(rf"^constrained / unconstrained throughput: {NUMBER} \([-+]{NUMBER}% loss; target <= 5%\)$",
                     report, re.M), report
