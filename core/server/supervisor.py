"""``tandem serve --disaggregated``: a router, one prefill and one decode instance from one command.

::

    tandem serve --disaggregated [MODEL] [flags]
      ├─ tandem serve --config prefill.toml --role prefill --host 127.0.0.1 --port <free>
      ├─ tandem serve --config decode.toml  --role decode  --host 127.0.0.1 --port <free>
      └─ tandem router --config router.toml --host <server.host> --port <server.port>

Each child gets the effective configuration (file < environment < flags) written to a temporary
TOML file, so every knob given to this command reaches it; the router's lists the two instances.
The cluster secret (``disaggregation.kv_transfer_secret``: the one configured, else a random one
made here, ``secrets.token_urlsafe``) goes to all three in their environment, never into a file.
The instances listen on 127.0.0.1 only; the router on ``server.host:server.port``. The parent
supervises: a child that exits (an instance whose engine failed for good exits 1, see
tandem.async_engine) is restarted with the same command and port, and the router's health checks
put it back in rotation once it is ready; a child that exits a ``MAX_RESTARTS + 1``-th time within
``RESTART_WINDOW_S`` is crash-looping: the parent says so, stops the others and exits 1. SIGINT
or SIGTERM stops all of them (SIGTERM, then SIGKILL after ``server.shutdown_timeout_s``) and
exits 0.
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.config import InstanceConfig, TandemConfig

SECRET_ENV = "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET"
POLL_S = 0.2
EXIT_OK = 0
EXIT_FAILURE = 1
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Added to this process's environment."""
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env})

    def may_restart(self, now: float) -> bool:
        """Whether a restart now stays within ``MAX_RESTARTS`` per ``RESTART_WINDOW_S``."""
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        return len(self.restarts) < MAX_RESTARTS


def _write_config(config: TandemConfig, folder: Path, name: str) -> str:
    path = folder / f"{name}.toml"
    path.write_text(config.to_toml())
    return str(path)


def plan_children(config: TandemConfig, folder: Path, uvicorn_log_level: str) -> list[Child]:
    """The three commands, with their config files written into ``folder`` and the cluster
    secret in their environment."""
    tandem = [sys.executable, "-m", "tandem.cli"]
    ports = {"prefill": free_port(), "decode": free_port()}
    secret = config.disaggregation.kv_transfer_secret
    env = {SECRET_ENV: secret.get_secret_value() if secret is not None else secrets.token_urlsafe(32)}
    children = []
    for role, port in ports.items():
        conf = _write_config(config, folder, role)
        children.append(Child(role, [*tandem, "serve", "--config", conf, "--role", role,
                                     "--host", "127.0.0.1", "--port", str(port),
                                     "--uvicorn-log-level", uvicorn_log_level], env))
    router_config = config.model_copy(deep=True)
    router_config.disaggregation.instances = [
        InstanceConfig(url=f"http://127.0.0.1:{port}", role=role) for role, port in ports.items()]
    conf = _write_config(router_config, folder, "router")
    children.append(Child("router", [*tandem, "router", "--config", conf,
                                     "--host", config.server.host, "--port", str(config.server.port),
                                     "--uvicorn-log-level", uvicorn_log_level], env))
    return children


def run_disaggregated(config: TandemConfig, uvicorn_log_level: str = "warning") -> int:
    """Start and supervise the three children (model path resolved); returns the exit status."""
    stop = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="tandem-disagg-") as folder:
        children = plan_children(config, Path(folder), uvicorn_log_level)
        try:
            for child in children:
                child.start()
                print(f"tandem: started the {child.name} process (pid {child.proc.pid})", flush=True)
            print(f"tandem: disaggregated serving of {config.model.path} through the router at "
                  f"http://{config.server.host}:{config.server.port}", flush=True)
            return _supervise(children, stop)
        finally:
            _stop_all(children, config.server.shutdown_timeout_s)
            for sig, handler in handlers.items():
                signal.signal(sig, handler)


def _supervise(children: list[Child], stop: list[int]) -> int:
    while not stop:
        for child in children:
            status = child.proc.poll()
            if status is None:
                continue
            now = time.monotonic()
            exited = f"the {child.name} process (pid {child.proc.pid}) exited with status {status}"
            if not child.may_restart(now):
                print(f"tandem serve: {exited}, its {MAX_RESTARTS + 1}th exit within "
                      f"{RESTART_WINDOW_S:.0f} s; stopping the others", file=sys.stderr, flush=True)
                return EXIT_FAILURE
            child.restarts.append(now)
            child.start()
            print(f"tandem serve: {exited}; restarted it (pid {child.proc.pid})", file=sys.stderr,
                  flush=True)
        time.sleep(POLL_S)
    return EXIT_OK


def _stop_all(children: list[Child], timeout_s: float) -> None:
    running = [c for c in children if c.proc is not None and c.proc.poll() is None]
    for child in running:
        child.proc.terminate()
    deadline = time.monotonic() + timeout_s + 5.0
    for child in running:
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
