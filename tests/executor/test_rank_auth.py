"""Ranks across hosts prove they hold the cluster secret (``disaggregation.kv_transfer_secret``)
before any step is exchanged, and the head proves it back; without a secret, several hosts are
refused unless the rendezvous is on the loopback.

Real processes on this host's loopback (``--nnodes 2`` with master_addr 127.0.0.1 runs both
"hosts" here): a ``tandem serve`` head and a ``tandem serve --headless`` rank with another
secret; the head and an impostor rank 1 (tests/executor/impostor_rank.py, plain torch, no
secret); a headless rank and a fake head (this test hosting the store, without the secret). The
HMACs the genuine rank sends are checked by hand here (the protocol in tandem.executor.rank_auth).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tandem import LLM
from tandem.config import ConfigError
from tests.executor.test_two_hosts import SECRET_ENV, child_env, serve_argv
from tests.helpers.tiny_models import tiny_model_dir
from tests.router.instances import free_port

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]
SECRET = "the-heads-cluster-secret-0123"
OTHER_SECRET = "a-different-secret-456789"
SETTING = "disaggregation.kv_transfer_secret"
WORKER_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 180.0
"""Each side imports torch and spawns a rank on two busy cores before the check runs."""


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("llama")


def _start(argv: list[str], secret: str | None, log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(argv, cwd=REPO, env=child_env(secret), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _finish(proc: subprocess.Popen, log_path: Path) -> tuple[int | None, str]:
    """The exit code (None when it was still running and is killed) and the log."""
    try:
        proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        return None, log_path.read_text()
    return proc.returncode, log_path.read_text()


def _head(model_dir: Path, master_port: int, secret: str | None, log_path: Path) -> subprocess.Popen:
    argv = serve_argv(model_dir, "127.0.0.1", 0, master_port, WORKER_TIMEOUT_S)
    return _start([*argv, "--port", str(free_port())], secret, log_path)


def _headless(model_dir: Path, master_port: int, secret: str | None, log_path: Path) -> subprocess.Popen:
    argv = serve_argv(model_dir, "127.0.0.1", 1, master_port, WORKER_TIMEOUT_S)
    return _start([*argv, "--headless"], secret, log_path)


def _no_step_was_run(log: str) -> bool:
    """Neither rank built its model, which comes before any step (``rank N of 2 ready``)."""
    return "KV pool" not in log and "of 2 ready" not in log


def test_a_rank_with_another_secret_is_refused_and_the_head_exits_naming_the_setting(model_dir, tmp_path):
    port = free_port()
    head = _head(model_dir, port, SECRET, tmp_path / "head.log")
    headless = _headless(model_dir, port, OTHER_SECRET, tmp_path / "headless.log")
    head_code, head_log = _finish(head, tmp_path / "head.log")
    headless_code, headless_log = _finish(headless, tmp_path / "headless.log")
    assert head_code == 1, head_log[-3000:]
    assert f"rank 1 did not prove it holds the cluster secret {SETTING}" in head_log, head_log[-3000:]
    assert "the engine failed to start" in head_log, head_log[-3000:]
    assert headless_code == 1 and SETTING in headless_log, headless_log[-3000:]
    assert _no_step_was_run(head_log + headless_log), (head_log + headless_log)[-3000:]
    for secret in (SECRET, OTHER_SECRET):
        assert secret not in head_log + headless_log


def test_an_impostor_rank_without_the_secret_is_refused_before_it_joins(model_dir, tmp_path):
    port = free_port()
    head = _head(model_dir, port, SECRET, tmp_path / "head.log")
    record_path = tmp_path / "impostor.json"
    impostor = _start([sys.executable, "-m", "tests.executor.impostor_rank", "127.0.0.1", str(port),
                       str(record_path)], None, tmp_path / "impostor.log")
    head_code, head_log = _finish(head, tmp_path / "head.log")
    _finish(impostor, tmp_path / "impostor.log")
    record = json.loads(record_path.read_text())
    assert head_code == 1, head_log[-3000:]
    assert f"rank 1 did not prove it holds the cluster secret {SETTING}" in head_log, head_log[-3000:]
    assert record["challenged"] and not record["joined"] and record["received_bytes"] == 0, record
    assert _no_step_was_run(head_log), head_log[-3000:]


def test_a_rank_answers_the_challenge_but_refuses_a_head_without_the_secret(model_dir, tmp_path):
    import torch.distributed as dist

    prefix = "tandem-rank-auth/"
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60), wait_for_workers=False)
    session, nonce = os.urandom(32), os.urandom(32)
    store.set(f"{prefix}challenge/1", session + nonce)
    headless = _headless(model_dir, port, SECRET, tmp_path / "headless.log")
    try:
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while not store.check([f"{prefix}response/1"]):
            assert headless.poll() is None and time.monotonic() < deadline, (tmp_path / "headless.log").read_text()
            time.sleep(0.1)
        answer = store.get(f"{prefix}response/1")
        mine, tag = answer[:32], answer[32:]
        message = b"tandem-ranks/rank" + session + (1).to_bytes(4, "big") + nonce + mine
        assert tag == hmac.new(SECRET.encode(), message, hashlib.sha256).digest()
        store.set(f"{prefix}proof/1", os.urandom(32))  # a head without the secret can only guess
    finally:
        code, log = _finish(headless, tmp_path / "headless.log")
    assert code == 1, log[-3000:]
    assert f"the head at 127.0.0.1:{port} did not prove it holds the cluster secret {SETTING}" in log, log[-3000:]
    assert _no_step_was_run(log) and SECRET not in log, log[-3000:]


def test_several_hosts_without_a_secret_need_a_loopback_master_addr(model_dir, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"parallel.master_addr = '192.0.2.1' needs the cluster secret {SETTING}"):
        LLM(model=str(model_dir), num_kv_blocks=64, tensor_parallel_size=2, nnodes=2, master_addr="192.0.2.1",
            master_port=free_port(), worker_timeout_s=5)


def test_a_headless_host_without_a_secret_and_a_remote_head_is_refused_at_start_up(model_dir):
    argv = serve_argv(model_dir, "192.0.2.1", 1, free_port(), 5)
    done = subprocess.run([*argv, "--headless"], cwd=REPO, env=child_env(None), capture_output=True,
                          text=True, timeout=EXIT_TIMEOUT_S)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"needs the cluster secret {SETTING}" in done.stderr and "tandem serve --headless" in done.stderr
