"""``tandem serve`` as a subprocess: named by its preset name, it builds and serves the demo model, it prints
where it listens and what it serves, and on SIGTERM it stops admitting, lets a running stream
finish within server.shutdown_timeout_s (or aborts it with an error when the timeout is shorter
than the stream), and exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tandem.bench.serve import free_port, start_process


def _start(model_args: list[str], shutdown_timeout_s: float, **env) -> tuple[subprocess.Popen, str]:
    """A `tandem serve` process on a free port, once /health answers. The port is free when picked
    but may be taken before the server binds it (by another process's outgoing connection, say):
    then the server exits with EADDRINUSE and a new port is tried, up to three times."""
    env = {**os.environ, "TANDEM_SERVER__SHUTDOWN_TIMEOUT_S": str(shutdown_timeout_s),
           "TANDEM_ENGINE__NUM_KV_BLOCKS": "64", **env}
    for attempt in range(3):
        port = free_port()
        cmd = [sys.executable, "-m", "tandem", "serve", *model_args, "--port", str(port)]
        try:
            return start_process(cmd, port, 120, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        except RuntimeError as exc:
            if attempt == 2 or "address already in use" not in str(exc):
                raise
    raise AssertionError("unreachable")


def _stream_until_sigterm(proc: subprocess.Popen, url: str, max_tokens: int) -> list[dict]:
    """Stream a completion; SIGTERM the server once the first token arrived; return the events."""
    body = {"prompt": "def main():", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                proc.send_signal(signal.SIGTERM)
            events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.timeout(240)
def test_the_demo_preset_by_name_is_built_and_served_and_sigterm_lets_the_stream_finish(tmp_path):
    proc, url = _start(["demo"], shutdown_timeout_s=60, TANDEM_CACHE_DIR=str(tmp_path))
    try:
        events = _stream_until_sigterm(proc, url, max_tokens=300)
        texts = [e for e in events if "choices" in e]
        assert texts[-1]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in events)
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=2)
        demo = tmp_path / "models" / "demo"
        assert (demo / "config.json").is_file()
        stdout = proc.stdout.read()
        assert f"serving model 'demo' from {demo}" in stdout and url in stdout
    finally:
        proc.kill()


@pytest.mark.timeout(180)
def test_sigterm_aborts_what_outlives_the_timeout_and_exits_0(model_dir):
    proc, url = _start([str(model_dir)], shutdown_timeout_s=0)
    try:
        events = _stream_until_sigterm(proc, url, max_tokens=480)
        assert events[-1]["error"]["code"] == "shutdown"
        generated = sum(1 for e in events if "choices" in e)
        assert generated < 480
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
