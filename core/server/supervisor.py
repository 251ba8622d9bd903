"""``tandem serve --disaggregated``: a router, one prefill and one decode instance from one command.

::

    tandem serve --disaggregated [MODEL] [flags]
      ├─ tandem serve --config prefill.toml --role prefill --host 127.0.0.1 --port <free>
      ├─ tandem serve --config decode.toml  --role decode  --host 127.0.0.1 --port <free>
      └─ tandem router --config router.toml --host <server.host> --port <server.port>

Each child gets the effective configuration (file < environment < flags) written to a temporary
TOML file, so every knob given to this command reaches it; the router's lists the two instances.
Secrets never go into those files nor on a command line (``ps``): the cluster secret
(``disaggregation.kv_transfer_secret``), the router's admin key and ``server.api_key`` go to the
children in their environment, readable by the same user only. A cluster secret or admin key
that is not configured is made here (``secrets.token_urlsafe``) and written for the operator to a
0600 file in a 0700 folder of the state directory (``$TANDEM_STATE_DIR``, else
``$XDG_STATE_HOME/tandem``, else ``~/.local/state/tandem``); the files' paths are printed, never
their values. The instances listen on 127.0.0.1 only; the router on ``server.host:server.port``.
The parent supervises: a child that exits (an instance whose engine failed for good exits 1, see
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

from pydantic import SecretStr

from tandem.config import KV_SECRET_ENV, InstanceConfig, TandemConfig

SECRET_ENV = KV_SECRET_ENV
ADMIN_KEY_ENV = "TANDEM_DISAGGREGATION__ROUTER_ADMIN_KEY"
API_KEY_ENV = "TANDEM_SERVER__API_KEY"
_SECRET_FILE_ENVS = {f"{v}_FILE" for v in (SECRET_ENV, ADMIN_KEY_ENV, API_KEY_ENV)}
"""Not passed on: the children get the secrets themselves (a value and its file is an error)."""
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
        inherited = {k: v for k, v in os.environ.items() if k.upper() not in _SECRET_FILE_ENVS}
        self.proc = subprocess.Popen(self.argv, env={**inherited, **self.env})

    def may_restart(self, now: float) -> bool:
        """Whether a restart now stays within ``MAX_RESTARTS`` per ``RESTART_WINDOW_S``."""
        self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S]
        return len(self.restarts) < MAX_RESTARTS


def _write_config(config: TandemConfig, folder: Path, name: str) -> str:
    path = folder / f"{name}.toml"
    path.write_text(config.to_toml())
    return str(path)


def state_dir() -> Path:
    """Where ``tandem serve --disaggregated`` writes the secrets it makes (module docstring)."""
    if os.environ.get("TANDEM_STATE_DIR"):
        return Path(os.environ["TANDEM_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tandem"


def write_secret_file(folder: Path, name: str, value: str) -> Path:
    """``value`` in ``folder/name``, readable by this user alone (0600, in a 0700 folder)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(value + "\n")
    return path


def cluster_secrets(config: TandemConfig) -> tuple[dict[str, str], list[Path]]:
    """The children's secret environment, and the files written for the secrets made here."""
    disagg, folder = config.disaggregation, state_dir() / f"disaggregated-{config.server.port}"
    env, written = {}, []
    for variable, value, name in ((SECRET_ENV, disagg.kv_transfer_secret, "kv_transfer_secret"),
                                  (ADMIN_KEY_ENV, disagg.router_admin_key, "router_admin_key")):
        if value is None:
            value = SecretStr(secrets.token_urlsafe(32))
            written.append(write_secret_file(folder, name, value.get_secret_value()))
        env[variable] = value.get_secret_value()
    if config.server.api_key is not None:
        env[API_KEY_ENV] = config.server.api_key.get_secret_value()
    return env, written


def _without_secrets(config: TandemConfig) -> TandemConfig:
    """``config`` for a child's file: its secrets come by the environment, not their files."""
    config = config.model_copy(deep=True)
    config.server.api_key_file = None
    config.disaggregation.router_admin_key_file = None
    config.disaggregation.kv_transfer_secret_file = None
    return config


def plan_children(config: TandemConfig, folder: Path, uvicorn_log_level: str,
                  env: dict[str, str] | None = None) -> list[Child]:
    """The three commands, with their config files written into ``folder`` and ``env`` (the
    secrets of ``cluster_secrets``; made afresh when None) in their environment."""
    tandem = [sys.executable, "-m", "tandem.cli"]
    ports = {"prefill": free_port(), "decode": free_port()}
    env = cluster_secrets(config)[0] if env is None else env
    instance_env = {k: v for k, v in env.items() if k != ADMIN_KEY_ENV}
    config = _without_secrets(config)
    children = []
    for role, port in ports.items():
        conf = _write_config(config, folder, role)
        children.append(Child(role, [*tandem, "serve", "--config", conf, "--role", role,
                                     "--host", "127.0.0.1", "--port", str(port),
                                     "--uvicorn-log-level", uvicorn_log_level, *_kv_event_ports(config)],
                              instance_env))
    router_config = config.model_copy(deep=True)
    router_config.disaggregation.instances = [
        InstanceConfig(url=f"http://127.0.0.1:{port}", role=role) for role, port in ports.items()]
    conf = _write_config(router_config, folder, "router")
    children.append(Child("router", [*tandem, "router", "--config", conf,
                                     "--host", config.server.host, "--port", str(config.server.port),
                                     "--uvicorn-log-level", uvicorn_log_level], env))
    return children


def _kv_event_ports(config: TandemConfig) -> list[str]:
    """Both instances publishing KV events on one host: each on free ports (the router finds them
    at GET /kv/events), not both on the configured ones."""
    events = config.kv_events
    if not events.enabled:
        return []
    free = "tcp://127.0.0.1:0"
    replay = [] if events.replay_endpoint is None else ["--kv-events-replay-endpoint", free]
    return ["--kv-events-endpoint", free, *replay]


def run_disaggregated(config: TandemConfig, uvicorn_log_level: str = "warning") -> int:
    """Start and supervise the three children (model path resolved); returns the exit status."""
    stop = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="tandem-disagg-") as folder:
        env, written = cluster_secrets(config)
        children = plan_children(config, Path(folder), uvicorn_log_level, env)
        try:
            for child in children:
                child.start()
                print(f"tandem: started the {child.name} process (pid {child.proc.pid})", flush=True)
            for path in written:
                print(f"tandem: made the cluster's {path.name}: it is in {path} (readable by this "
                      f"user only)", flush=True)
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
