"""``HandshakeCache``: how a decode instance fetches prefill instances' handshakes — against a
real HTTP server on 127.0.0.1 that answers what each test scripts and records what it was sent."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tandem.server.disagg import HANDSHAKE_MAX_BYTES, KV_SECRET_HEADER, HandshakeCache, HandshakeError

Answer = Callable[[BaseHTTPRequestHandler], None]


class Peer:
    """Answers GET /<engine id> with ``answer`` (by default that engine's handshake)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.secrets: list[str | None] = []
        self.answer: Answer = _handshake_of_path
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 — http.server's name
                peer.paths.append(self.path)
                peer.secrets.append(self.headers.get(KV_SECRET_HEADER))
                peer.answer(self)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, engine_id: str) -> str:
        return f"{self.base}/{engine_id}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _send(handler: BaseHTTPRequestHandler, status: int, payload: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


def _handshake_of_path(handler: BaseHTTPRequestHandler) -> None:
    _send(handler, 200, json.dumps({"engine_id": handler.path.lstrip("/"), "agent": "meta"}).encode())


@pytest.fixture
def peer() -> Iterator[Peer]:
    server = Peer()
    yield server
    server.close()


def get(cache: HandshakeCache, engine_id: str, url: str) -> dict:
    return asyncio.run(cache.get(engine_id, url))


@pytest.mark.timeout(30)
def test_a_handshake_is_fetched_once_per_engine_id_with_the_secret(peer):
    cache = HandshakeCache(secret="the-cluster-secret-0123")
    assert get(cache, "a", peer.url("a")) == {"engine_id": "a", "agent": "meta"}
    assert get(cache, "a", peer.url("a"))["engine_id"] == "a"
    assert get(cache, "b", peer.url("b"))["engine_id"] == "b"  # a restarted instance: a new id
    assert peer.paths == ["/a", "/b"]
    assert peer.secrets == ["the-cluster-secret-0123"] * 2
    assert get(HandshakeCache(), "c", peer.url("c"))["engine_id"] == "c"
    assert peer.secrets[-1] is None


@pytest.mark.timeout(30)
def test_the_cache_keeps_the_most_recently_used_engines(peer):
    cache = HandshakeCache(max_entries=3)
    for engine_id in "abc":
        get(cache, engine_id, peer.url(engine_id))
    get(cache, "a", peer.url("a"))  # a is now the most recently used: b goes first
    get(cache, "d", peer.url("d"))
    assert len(cache) == 3 and "b" not in cache and all(e in cache for e in "acd")
    get(cache, "b", peer.url("b"))
    assert peer.paths == ["/a", "/b", "/c", "/d", "/b"]


def _status(code: int) -> Answer:
    return lambda handler: _send(handler, code, b'{"error": {}}')


def _other_engine(handler: BaseHTTPRequestHandler) -> None:
    _send(handler, 200, b'{"engine_id": "someone-else"}')


def _not_an_object(handler: BaseHTTPRequestHandler) -> None:
    _send(handler, 200, b"[1, 2]")


def _redirect(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(302)
    handler.send_header("Location", "http://127.0.0.1:9/elsewhere")
    handler.send_header("Content-Length", "0")
    handler.end_headers()


def _endless(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()
    try:
        for _ in range(64):
            handler.wfile.write(b" " * (64 << 10))
    except (BrokenPipeError, ConnectionResetError):
        pass


def _slow_drip(handler: BaseHTTPRequestHandler) -> None:
    handler.send_response(200)
    handler.end_headers()
    try:
        for _ in range(20):  # a byte every 0.2 s: no single read times out, the whole fetch must
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer, reason", [
    (_status(401), "answered 401"),
    (_status(500), "answered 500"),
    (_redirect, "answered 302"),
    (_other_engine, "the handshake of another engine ('someone-else')"),
    (_not_an_object, "not an object"),
    (_endless, f"more than {64 << 10} bytes"),
    (_slow_drip, "within 1 s"),
])
def test_a_failed_fetch_raises_and_leaves_no_entry(peer, answer, reason):
    peer.answer = answer
    cache = HandshakeCache(timeout_s=1.0, max_bytes=64 << 10)
    start = time.monotonic()
    with pytest.raises(HandshakeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        get(cache, "a", peer.url("a"))
    assert time.monotonic() - start < 5
    assert "a" not in cache and len(cache) == 0
    peer.answer = _handshake_of_path  # the next fetch of the same engine goes to the network again
    cache.timeout_s = 10.0  # a loaded machine may take over 1 s to answer; only the failure was timed
    assert get(cache, "a", peer.url("a"))["engine_id"] == "a"
    assert peer.paths == ["/a", "/a"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("payload, reason", [
    (b"[" * HANDSHAKE_MAX_BYTES, f"nested {HANDSHAKE_MAX_BYTES} deep"),
    (b'{"engine_id": "a", "x": ' + b"[" * 9 + b"]" * 9 + b"}", "nested 10 deep"),
    (b'{"engine_id": "a", "x": [[1]], "y": "' + b"[" * 4096 + b'"', "not a handshake"),
])
def test_a_deep_or_broken_handshake_is_a_handshake_error(peer, payload, reason):
    """A mebibyte of ``[`` is within the size limit; parsed, it would end in RecursionError.
    Brackets inside a string are no nesting: that last body is refused only as broken JSON."""
    peer.answer = lambda handler: _send(handler, 200, payload)
    with pytest.raises(HandshakeError, match=reason):
        get(HandshakeCache(), "a", peer.url("a"))
    peer.answer = lambda handler: _send(handler, 200, b'{"engine_id": "a", "s": "' + b"[" * 4096 + b'"}')
    assert get(HandshakeCache(), "a", peer.url("a"))["s"] == "[" * 4096


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x", "/kv/handshake"])
def test_only_http_urls_are_fetched(url):
    with pytest.raises(HandshakeError, match="not an http"):
        get(HandshakeCache(), "a", url)


@pytest.mark.timeout(30)
def test_an_unreachable_peer_raises(peer):
    url = peer.url("a")
    peer.close()
    with pytest.raises(HandshakeError, match="ConnectError"):
        get(HandshakeCache(), "a", url)
