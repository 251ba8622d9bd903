"""What the router tests run against: ``tandem serve`` subprocesses of the tiny Llama on free
ports of 127.0.0.1 (killable with -9 without touching the test process), the router app under a
real uvicorn in a thread, and scraping of Prometheus text with prometheus_client's own parser."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tandem.bench.cluster_io import scrape  # noqa: F401 - the tests import it from here
from tandem.config import load_config
from tandem.router.app import create_router_app
from tests.server.conftest import ServerThread

MODEL_NAME = "tiny"
CLUSTER_SECRET = "cluster-secret-of-the-router-tests"
"""The cluster secret of ``role_env``'s instances and of ``running_router`` (unless told otherwise)."""
ADMIN_KEY = "admin-key-of-the-router-tests"
"""``running_router``'s admin key (unless told otherwise)."""
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
KV_SECRET = {"X-Tandem-KV-Secret": CLUSTER_SECRET}
"""The header of a request carrying kv_transfer_params, as the router sends it."""
PAIR_EXPIRY_S = 3.0
"""The KV expiry of the session's disaggregated pair (tests/router/conftest.py ``nixl_pair``)."""
INSTANCE_FLAGS = ["--served-model-name", MODEL_NAME, "--num-kv-blocks", "64", "--max-num-seqs", "8",
                  "--max-num-batched-tokens", "256"]


def role_env(role: str, kv_expiry_s: float, **extra: str) -> dict[str, str]:
    """The environment of a disaggregated instance of ``role`` over the nixl connector, with the
    tests' cluster secret (``extra`` may give another)."""
    return {"TANDEM_DISAGGREGATION__ROLE": role, "TANDEM_DISAGGREGATION__KV_CONNECTOR": "nixl",
            "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET": CLUSTER_SECRET,
            "TANDEM_DISAGGREGATION__KV_EXPIRY_S": str(kv_expiry_s),
            "TANDEM_DISAGGREGATION__KV_TRANSFER_TIMEOUT_S": "5", **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InstanceProcess:
    """``tandem serve MODEL --port N`` as a subprocess; its output goes to ``log_dir``. ``flags``
    come after INSTANCE_FLAGS (a flag given twice: the last one counts)."""

    def __init__(self, model_dir: Path, log_dir: Path, port: int | None = None, flags: tuple[str, ...] = (),
                 **env: str) -> None:
        self.model_dir = model_dir
        self.flags = flags
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"instance-{self.port}.log"
        self.env = {**os.environ, "TANDEM_ENGINE__NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **env}
        self.proc: subprocess.Popen | None = None

    def start(self) -> InstanceProcess:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.cli", "serve", str(self.model_dir), "--port", str(self.port),
                 *INSTANCE_FLAGS, *self.flags], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 180.0) -> InstanceProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the instance exited:\n{self.log_path.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"the instance did not start:\n{self.log_path.read_text()}")

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        """kill -9, and wait until the process is gone (its port is closed)."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.kill()


@contextmanager
def instances(model_dir: Path, log_dir: Path, count: int, **env: str) -> Iterator[list[InstanceProcess]]:
    """``count`` instances, started together, stopped at the end."""
    procs = [InstanceProcess(model_dir, log_dir, **env).start() for _ in range(count)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@contextmanager
def running_router(instance_list: list[tuple[str, str]], health_interval_s: float = 0.2,
                   **overrides) -> Iterator[ServerThread]:
    """The router over ``[(url, role), ...]`` under uvicorn; ``overrides`` are config fields by
    name (routing_policy="round_robin", api_key="k", ...). It has the tests' cluster secret and
    admin key unless ``overrides`` give others (None: unset)."""
    instances_field = [{"url": u, "role": r} for u, r in instance_list]
    overrides = {"kv_transfer_secret": CLUSTER_SECRET, "router_admin_key": ADMIN_KEY, **overrides}
    config = load_config(overrides={"disaggregation.instances": instances_field, **overrides}, env={})
    server = ServerThread(create_router_app(config, health_interval_s=health_interval_s))
    server.start(wait_ready=False)
    try:
        yield server
    finally:
        server.stop()


def upstream(router_url: str, instance: str, step: str, outcome: str) -> float:
    """The router's count of attempts on ``instance`` for ``step`` with ``outcome``."""
    key = f"tandem:router_upstream_requests_total{{instance={instance},outcome={outcome},step={step}}}"
    return scrape(router_url).get(key, 0.0)


def dispatched(router_url: str, path: str) -> float:
    return scrape(router_url).get(f"tandem:router_requests_total{{path={path}}}", 0.0)


def router_instance(router_url: str, url: str, admin_key: str = ADMIN_KEY) -> dict:
    headers = {"Authorization": f"Bearer {admin_key}"}
    listed = httpx.get(f"{router_url}/admin/instances", headers=headers, timeout=10).json()["instances"]
    return next(i for i in listed if i["url"] == url)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def wait_healthy(url: str, failure: Callable[[], str | None], timeout_s: float, what: str = "the instance") -> None:
    """Until ``url``/health answers 200. ``failure()`` says why the process cannot come up
    (it exited: its log) or None; raises AssertionError with that, or TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reason = failure()
        assert reason is None, f"{what} exited during start-up:\n{reason}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not start within {timeout_s:g} s:\n{failure() or ''}")


def completion(url: str, body: dict, path: str = "/v1/completions") -> dict:
    """A non-streamed answer of ``url`` (an instance: the oracle, or the router)."""
    response = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()
