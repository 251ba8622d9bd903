"""A short chaos run (``tandem.bench.chaos``): a colocated oracle, a prefill and a decode instance
over the "faulty" connector wrapping NIXL, and a router, all real processes on 127.0.0.1. The
fault rates are high enough that every kind fires, and clients hang up on some extra requests
(aborts during hand-overs); no request may be lost, every answer must
equal the colocated instance's, and every instance must end with no block in use, pinned or
quarantined. Truncated reads must be caught by the block checksums and failed reads observed.
Delays stay within the transfer deadline here: a read past it stalls its peer (every hand-over
from it recomputes until the read is over), which in a run this short would starve the other
faults; tests/transport/test_faulty_connector.py covers it."""
from __future__ import annotations

import pytest

from tandem.bench.chaos import format_report, run_chaos

pytest.importorskip("nixl_cu12", reason="the faulty connector wraps the nixl connector here")

FAULTS = {"read_fail_rate": 0.2, "read_delay_rate": 0.2, "read_delay_s": 0.6, "truncate_rate": 0.2,
          "notify_drop_rate": 0.2, "notify_delay_rate": 0.2, "notify_delay_s": 0.3,
          "restart_every_n": 5, "seed": 17}
TRANSFER_TIMEOUT_S = 1.0


@pytest.mark.timeout(240)
def test_no_request_is_lost_no_answer_differs_and_no_block_leaks_under_faults(model_dir, tmp_path):
    report = run_chaos(str(model_dir), FAULTS, conversations_=20, turns=3, max_tokens=6, concurrency=4,
                       seed=3, abort_rate=0.2, expiry_s=2.0, transfer_timeout_s=TRANSFER_TIMEOUT_S,
                       log_dir=tmp_path)
    summary = format_report(report)
    assert report.requests == 60 and report.abandoned >= 1, summary
    assert report.lost == [] and report.wrong == [] and report.leaks == {}, summary
    injected, observed = report.injected, report.observed
    for kind in ("read_fail", "truncate", "notify_drop", "notify_delay", "restart"):
        assert injected.get(kind, 0) >= 1, summary
    assert injected.get("read_delay", 0) >= 1, summary
    # a fault in the read of a request its client abandoned meanwhile ends no load: fewer observed
    assert 1 <= observed.get("checksum", 0) <= injected["truncate"], summary
    assert 1 <= observed.get("transfer", 0) <= injected["read_fail"], summary
    assert observed.get("peer", 0) >= 1, summary  # reads of a restarted agent's stale handshake


@pytest.mark.timeout(240)
def test_streamed_hand_overs_under_faults_lose_nothing_and_leak_nothing(model_dir, tmp_path):
    """The same with the prefill instance streaming its hand-overs (a block a step): reads of
    announced blocks fail, are truncated (caught by the announced checksums) or delayed, and
    the prefill agent restarts mid-stream."""
    report = run_chaos(str(model_dir), FAULTS, conversations_=10, turns=3, max_tokens=6, concurrency=4,
                       seed=5, abort_rate=0.2, expiry_s=2.0, transfer_timeout_s=TRANSFER_TIMEOUT_S,
                       stream_kv=True, log_dir=tmp_path)
    summary = format_report(report)
    assert report.requests == 30, summary
    assert report.lost == [] and report.wrong == [] and report.leaks == {}, summary
    assert report.injected.get("truncate", 0) >= 1 and report.injected.get("read_fail", 0) >= 1, summary
    assert 1 <= report.observed.get("checksum", 0) <= report.injected["truncate"], summary
