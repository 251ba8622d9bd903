"""One instance over two hosts: tensor parallelism (tp = 2) across two test hosts (network
namespaces on a veth bridge, tests/helpers/netns.py), gloo over TCP between them::

    host 1  10.A.B.2   tandem serve -tp 2 --nnodes 2 --node-rank 0   API :8000, rank 0, rendezvous :29500
    host 2  10.A.B.3   tandem serve --headless ... --node-rank 1     rank 1

Both hosts get the cluster secret (``disaggregation.kv_transfer_secret``, by the environment),
which every rank proves it holds before any step is exchanged (test_rank_auth.py has the
refusals). No GLOO_SOCKET_IFNAME is set: a namespace's hostname resolves to none of its
addresses (here, to 127.0.0.1), where gloo would bind the loopback; tandem must pick the veth
interface itself (tandem.executor.netif). The oracle is HF transformers' greedy ``generate`` on the same
checkpoint; a head alone, and a head whose other host is killed -9 mid-stream, must exit
non-zero within ``--worker-timeout-s``, saying why.

Without root, or where namespaces cannot be made, every test here skips and says why.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts, hf_greedy
from tests.helpers.netns import Host, TestHosts, test_hosts
from tests.helpers.tiny_models import tiny_model_dir, tiny_tokenizer
from tests.router.instances import wait_healthy

MODEL_NAME = "tiny"
API_PORT = 8000
MASTER_PORT = 29500
WORKER_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0
"""Both hosts import torch and spawn a rank on the same cores: 20 to 35 s on two busy cores."""
MAX_TOKENS = 12
LENGTHS = [3, 17, 33, 48]
SECRET_ENV = "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET"
CLUSTER_SECRET = "two-hosts-cluster-secret-0123456789"


def child_env(secret: str | None = CLUSTER_SECRET) -> dict[str, str]:
    """The test's environment without TANDEM_ and gloo settings, with ``secret`` as the cluster
    secret (by the environment: never on a command line)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "GLOO_", "TP_SOCKET"))}
    env = {**env, "OMP_NUM_THREADS": "1", "TANDEM_ENGINE__NUM_THREADS": "1"}
    return env if secret is None else {**env, SECRET_ENV: secret}


def serve_argv(model_dir: Path, master_addr: str, node_rank: int, master_port: int,
               worker_timeout_s: float) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", "serve", str(model_dir), "--served-model-name", MODEL_NAME,
            "--num-kv-blocks", "64", "--worker-timeout-s", f"{worker_timeout_s:g}", "-tp", "2",
            "--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", master_addr,
            "--master-port", str(master_port)]


@dataclass
class TwoHostInstance:
    """The head (``tandem serve``, the API) in ``net[0]``, the headless host in ``net[1]``, each
    in its own process group (killed with ``os.killpg``)."""

    net: TestHosts
    model_dir: Path
    log_dir: Path
    head: subprocess.Popen | None = None
    headless: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.net[0].address}:{API_PORT}"

    @property
    def alive(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.head, self.headless))

    def start(self) -> TwoHostInstance:
        self.stop()
        head_host = self.net[0]
        argv = serve_argv(self.model_dir, head_host.address, 0, MASTER_PORT, WORKER_TIMEOUT_S)
        self.head = _popen(head_host, [*argv, "--host", head_host.address, "--port", str(API_PORT)],
                           self.log_dir / "head.log")
        argv = serve_argv(self.model_dir, head_host.address, 1, MASTER_PORT, WORKER_TIMEOUT_S)
        self.headless = _popen(self.net[1], [*argv, "--headless"], self.log_dir / "headless.log")
        return self

    def wait_ready(self) -> TwoHostInstance:
        wait_healthy(self.url, lambda: None if self.alive else self.logs(), START_TIMEOUT_S, "a host")
        return self

    def stop(self) -> None:
        for proc in (self.head, self.headless):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)

    def logs(self, chars: int = 2500) -> str:
        return "\n".join(f"--- {name}\n{(self.log_dir / name).read_text()[-chars:]}"
                         for name in ("head.log", "headless.log") if (self.log_dir / name).exists())


def _popen(host: Host, argv: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return host.popen(argv, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir("llama")  # built before any process reads it


@pytest.fixture(scope="module")
def hosts() -> Iterator[TestHosts]:
    with test_hosts(2) as net:
        yield net


@pytest.fixture(scope="module")
def shared_instance(hosts, model_dir, tmp_path_factory) -> Iterator[TwoHostInstance]:
    instance = TwoHostInstance(hosts, model_dir, tmp_path_factory.mktemp("two-hosts"))
    yield instance
    instance.stop()


@pytest.fixture
def instance(shared_instance) -> TwoHostInstance:
    """The module's instance, (re)started when it is not running (a test here kills it)."""
    if not shared_instance.alive:
        started = time.monotonic()
        shared_instance.start().wait_ready()
        print(f"\ntp=2 over hosts {shared_instance.net.subnet}: ready in {time.monotonic() - started:.1f} s")
    return shared_instance


@pytest.mark.timeout(240)
def test_greedy_tokens_across_two_hosts_equal_hf(instance):
    prompts = _prompts(31, LENGTHS)
    expected = hf_greedy(instance.model_dir, prompts, MAX_TOKENS)
    tokenizer = tiny_tokenizer()
    sent_before = instance.net.bytes_to_host(2)
    body = {"model": MODEL_NAME, "prompt": prompts, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0.0, "logprobs": 0}
    response = httpx.post(f"{instance.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, f"{response.text}\n{instance.logs()}"
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    # token for token: each sampled token's own text (the logprobs), and the whole text
    assert [c["logprobs"]["tokens"] for c in choices] == [[tokenizer.decode([t]) for t in e] for e in expected]
    assert [c["text"] for c in choices] == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    # rank 1 got rank 0's partial sums across the bridge: at least a hidden state per prompt
    # token and layer (float32)
    config = json.loads((instance.model_dir / "config.json").read_text())
    least = sum(LENGTHS) * config["hidden_size"] * 4 * config["num_hidden_layers"]
    assert instance.net.bytes_to_host(2) - sent_before >= least


@pytest.mark.timeout(120)
def test_head_fails_start_up_when_the_other_host_never_joins(hosts, model_dir, tmp_path):
    worker_timeout_s = 10.0
    head = hosts[0]
    argv = serve_argv(model_dir, head.address, 0, MASTER_PORT + 1, worker_timeout_s)
    log_path = tmp_path / "head-alone.log"
    started = time.monotonic()
    proc = _popen(head, [*argv, "--host", head.address, "--port", str(API_PORT + 1)], log_path)
    try:
        proc.wait(worker_timeout_s + START_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    seconds = time.monotonic() - started
    log = log_path.read_text()
    print(f"\na head alone (worker_timeout_s = {worker_timeout_s:g}) exited {proc.returncode} after {seconds:.1f} s")
    assert proc.returncode == 1, log[-3000:]
    assert "the engine failed to start" in log and "did not all join the rendezvous" in log, log[-3000:]
    assert f"within {worker_timeout_s:g} s" in log and "tandem serve --headless" in log, log[-3000:]


@pytest.mark.timeout(240)
def test_head_exits_when_the_other_host_is_killed_while_serving(instance):
    body = {"model": MODEL_NAME, "prompt": _prompts(32, [8])[0], "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.0, "stream": True}
    events = []
    with httpx.stream("POST", f"{instance.url}/v1/completions", json=body, timeout=WORKER_TIMEOUT_S) as response:
        assert response.status_code == 200, (response.read(), instance.logs())
        lines = response.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        os.killpg(instance.headless.pid, signal.SIGKILL)
        killed = time.monotonic()
        events += [line for line in lines if line.startswith("data: ")]
    instance.head.wait(WORKER_TIMEOUT_S)
    seconds = time.monotonic() - killed
    print(f"\nthe headless host killed -9 mid-stream: the head exited {instance.head.returncode} "
          f"{seconds:.1f} s later, after {len(events)} stream events")
    assert instance.head.returncode == 1, instance.logs()
    assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][6:]), events[-3:]
    assert "the engine failed, exiting" in instance.logs(), instance.logs()
    assert seconds < WORKER_TIMEOUT_S


@pytest.mark.timeout(240)
def test_head_exits_when_the_other_host_is_killed_while_idle(instance):
    """No request has to come: the idle head pings the other host's rank every few seconds."""
    from tandem.executor.mp import HEALTH_PING_S

    os.killpg(instance.headless.pid, signal.SIGKILL)
    killed = time.monotonic()
    instance.head.wait(WORKER_TIMEOUT_S)
    seconds = time.monotonic() - killed
    print(f"\nthe headless host killed -9 while idle: the head exited {instance.head.returncode} {seconds:.1f} s later")
    assert instance.head.returncode == 1, instance.logs()
    assert "the engine failed, exiting" in instance.logs(), instance.logs()
    assert seconds < HEALTH_PING_S + 10
