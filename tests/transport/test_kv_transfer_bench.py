"""`tandem bench kv-transfer` (tandem.bench.kv_transfer) on a small layout: it reads from real
owner processes, on this host and from one test host to another across a veth bridge, checks
every read against the owner's seeded pool, and prints the bandwidths and their ratios."""
from __future__ import annotations

import argparse
import os
import re

import pytest

from tandem.bench import kv_transfer, netns
from tests.helpers.netns import skip_reason

pytest.importorskip("nixl")

ROWS = ("nixl read, same host, shm (UCX's choice)", "nixl read, same host, TCP over lo")
TWO_HOSTS_ROW = "nixl read, two hosts, TCP over a veth bridge"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    kv_transfer.add_arguments(parser)
    return parser.parse_args(["--pool-blocks", "64", "--num-layers", "2", "--repeats", "3",
                              "--warmup", "1", *argv])


def _bandwidth(out: str, row: str) -> float:
    match = re.search(re.escape(row) + r"\s+[\d.]+ ms\s+([\d.]+) GiB/s  \(bytes verified\)", out)
    assert match, out
    return float(match.group(1))


@pytest.mark.timeout(120)
def test_bench_reports_same_host_bandwidths_and_their_ratio(capsys):
    assert kv_transfer.run(bench_args("--prompt-tokens", "200", "--hosts", "none")) == 0
    out = capsys.readouterr().out
    assert "13 scattered blocks (200 tokens) of 64 KiB" in out
    assert "torch copy, in-process" in out
    assert all(_bandwidth(out, row) > 0 for row in ROWS)
    assert "nixl / torch copy:" in out
    assert TWO_HOSTS_ROW not in out


@pytest.mark.timeout(180)
def test_bench_reads_between_two_test_hosts_over_the_veth_bridge(capsys):
    try:  # the bench makes its own hosts; this only finds out whether it can
        netns.TestHosts(1).open().close()
    except netns.HostsUnavailable as exc:
        pytest.skip(skip_reason(exc))
    assert kv_transfer.run(bench_args("--prompt-tokens", "200", "--hosts", "netns")) == 0
    out = capsys.readouterr().out
    assert all(_bandwidth(out, row) > 0 for row in (*ROWS, TWO_HOSTS_ROW))
    assert re.search(r"two hosts / same host tcp: \d+%; two hosts / same host shm: \d+%", out), out
    # the kernel's counters of the reader's veth saw at least every byte of the 4 reads
    crossed = re.search(r"over the veth bridge: ([\d.]+) MiB for 4 reads of ([\d.]+) MiB", out)
    assert crossed and float(crossed.group(1)) >= 4 * float(crossed.group(2)), out
    assert float(crossed.group(2)) == pytest.approx(13 * 64 / 1024, abs=0.05)


@pytest.mark.timeout(120)
def test_bench_reads_a_tp2_decode_ranks_heads_exactly(capsys):
    """Half of the 2 KV heads: one 256-byte run per (layer, K/V, token) of each block; the reader
    checks the bytes against the owner's heads and its connector's counters against the runs."""
    assert kv_transfer.run(bench_args("--prompt-tokens", "200", "--hosts", "none", "--reader-tp", "2",
                                      "--num-kv-heads", "2")) == 0
    out = capsys.readouterr().out
    assert "tensor rank 0 of 2, 1 of 2 KV heads: 832 descriptors of 256 bytes = 0.2 MiB per read" in out
    assert all(_bandwidth(out, row) > 0 for row in ROWS)


def test_bench_that_requires_two_hosts_fails_where_they_cannot_be_made(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert kv_transfer.run(bench_args("--prompt-tokens", "200", "--hosts", "netns")) == 1
    assert "two hosts: not measured: making network namespaces needs root" in capsys.readouterr().out


def test_bench_refuses_more_blocks_than_the_pool_holds():
    with pytest.raises(SystemExit, match="needs 125 blocks"):
        kv_transfer.run(bench_args("--prompt-tokens", "2000"))
