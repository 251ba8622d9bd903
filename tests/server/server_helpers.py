"""Server test helpers: a real uvicorn on a free port of 127.0.0.1 in a background thread, and
a reader of its Prometheus metrics."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from tandem.bench.cluster_io import scrape  # noqa: F401 - the tests import it from here
from tandem.config import ServerConfig, TandemConfig, load_config
from tandem.server.app import create_app
from tandem.http_limits import uvicorn_config

# The engine knobs every server test and its offline oracle share.
ENGINE = {"num_kv_blocks": 64, "max_num_seqs": 8, "max_num_batched_tokens": 256, "num_threads": 1}


def server_config(model: str | Path, **overrides) -> TandemConfig:
    return load_config(overrides={"model.path": str(model), **ENGINE, **overrides})


class ServerThread:
    """uvicorn serving ``app`` on a socket bound to a free port, in a daemon thread, under the
    connection limits of ``server`` (as ``tandem serve`` runs it; the defaults when None)."""

    def __init__(self, app, server: ServerConfig | None = None) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, server or ServerConfig(), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    @property
    def engine(self):
        return self.app.state.tandem.engine

    def start(self, wait_ready: bool = True, timeout_s: float = 120.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = httpx.get(f"{self.url}/health", timeout=5).status_code
                if status == 200 or (status == 503 and not wait_ready):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the server did not stop"


@contextmanager
def running_server(config: TandemConfig, **app_kwargs) -> Iterator[ServerThread]:
    server = ServerThread(create_app(config, **app_kwargs), config.server).start()
    try:
        yield server
    finally:
        server.stop()

