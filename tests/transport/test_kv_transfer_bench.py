"""`tandem bench kv-transfer` (tandem.bench.kv_transfer) on a small layout: it reads from a real
owner process, checks every read against the owner's seeded pool, and prints both bandwidths."""
from __future__ import annotations

import argparse

import pytest

from tandem.bench import kv_transfer

pytest.importorskip("nixl")


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kv_transfer.add_arguments(parser)
    return parser.parse_args(["--pool-blocks", "64", "--num-layers", "2", "--repeats", "3",
                              "--warmup", "1", *argv])


@pytest.mark.timeout(120)
def test_bench_reports_both_bandwidths_and_their_ratio(capsys):
    assert kv_transfer.run(bench_args("--prompt-tokens", "200")) == 0
    out = capsys.readouterr().out
    assert "13 scattered blocks (200 tokens) of 64 KiB" in out
    assert "torch copy, in-process" in out
    assert "nixl read, other process" in out and "(bytes verified)" in out
    assert "nixl / torch copy:" in out


def test_bench_refuses_more_blocks_than_the_pool_holds():
    with pytest.raises(SystemExit, match="needs 125 blocks"):
        kv_transfer.run(bench_args("--prompt-tokens", "2000"))
