"""``tandem router --config FILE`` as a subprocess: it routes, stops with exit status 0 on SIGTERM,
refuses a bad config with status 2, and the router's modules stay off the engine (the dependency
rule of docs/architecture.md §1: the router talks to instances over HTTP only)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from tests.router.instances import CLUSTER_SECRET, MODEL_NAME, completion, free_port

BODY = {"model": MODEL_NAME, "prompt": "From the command line", "max_tokens": 6, "temperature": 0}


def write_config(tmp_path, instances: str, policy: str = "round_robin", secret: bool = True):
    path = tmp_path / "router.toml"
    path.write_text(textwrap.dedent(f"""
        [disaggregation]
        instances = [{instances}]
        routing_policy = "{policy}"
        decode_routing_policy = "least_loaded"
        router_admin_key = "k"
    """) + (f'kv_transfer_secret = "{CLUSTER_SECRET}"\n' if secret else ""))
    return path


def tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *args]


@pytest.mark.timeout(120)
def test_tandem_router_routes_and_exits_0_on_sigterm(cluster, tmp_path):
    instances = (f'{{url = "{cluster.prefill.url}", role = "prefill"}}, '
                 f'{{url = "{cluster.decode[0].url}", role = "decode"}}')
    port = free_port()
    proc = subprocess.Popen(tandem("router", "--config", str(write_config(tmp_path, instances)), "--port", str(port),
                                   "--health-interval-s", "0.2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        expected = completion(cluster.decode[0].url, BODY)["choices"][0]["text"]
        assert completion(url, BODY)["choices"][0]["text"] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert f"at http://127.0.0.1:{port}" in proc.stdout.read()
    finally:
        proc.kill()


def test_an_unknown_routing_policy_is_a_usage_error(tmp_path):
    config = write_config(tmp_path, '{url = "http://127.0.0.1:9", role = "decode"}', policy="random")
    result = subprocess.run(tandem("router", "--config", str(config)), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "routing_policy: no routing_policy named 'random'" in result.stderr
    assert "'round_robin'" in result.stderr


def test_a_router_over_prefill_and_decode_instances_without_the_cluster_secret_refuses_to_start(tmp_path):
    instances = '{url = "http://127.0.0.1:9", role = "prefill"}, {url = "http://127.0.0.1:10", role = "decode"}'
    config = write_config(tmp_path, instances, secret=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    result = subprocess.run(tandem("router", "--config", str(config), "--port", str(free_port())),
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    for part in ("disaggregation.kv_transfer_secret", "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET",
                 "tandem serve --disaggregated", "allow_insecure_no_secret"):
        assert part in result.stderr


def test_the_router_imports_neither_torch_nor_the_engine_nor_the_transport():
    code = ("import sys, tandem.router.app, tandem.router.launch, tandem.plugins.routing; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith("
            "('tandem.engine', 'tandem.server', 'tandem.transport', 'tandem.sched', 'tandem.worker'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
