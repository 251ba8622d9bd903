"""Bounded work per connection and per request, against a real uvicorn run as ``tandem serve``
runs it (``tandem.http_limits``): a body past ``server.max_request_body_bytes`` is a 413
before it is all read, long prompts are tokenized off the event loop, a request head that does
not arrive within ``server.header_timeout_s`` closes its connection, and sockets past
``server.max_connections`` evict the oldest half-open ones. Meanwhile /health answers within a
second. Oracles: the HTTP status lines and byte counts stated here, HF's tokenizer for the
token count of a long prompt."""
from __future__ import annotations

import gc
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from tandem.config import ServerConfig
from tandem.http_limits import limited_h11_protocol
from tests.helpers.raw_http import HEAD_64_MIB, connect, json_body, read_until_closed, send_chunked
from tests.server.server_helpers import running_server, server_config

BODY_LIMIT = 4 * 1024 * 1024  # the default of server.max_request_body_bytes
HEADER_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 64
HEALTH_BOUND_S = 1.0


@pytest.fixture(scope="module")
def limited(model_dir):
    config = server_config(model_dir, header_timeout_s=HEADER_TIMEOUT_S, keep_alive_timeout_s=1.0,
                           max_connections=MAX_CONNECTIONS)
    with running_server(config) as srv:
        gc.freeze()  # as tandem serve does once the model has loaded (tandem.server.launch)
        try:
            yield srv
        finally:
            gc.unfreeze()


@contextmanager
def health_timer(url: str) -> Iterator[list[float]]:
    """Times /health, one probe after another (each on a new connection, as a load balancer
    probes), for as long as the block runs; yields the latencies (a failed probe counts as
    infinitely slow)."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            start = time.monotonic()
            try:
                ok = httpx.get(f"{url}/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.monotonic() - start if ok else float("inf"))
            time.sleep(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    # the first probe is answered before the block starts: a probe whose connection opened
    # before a flood is among the oldest half-open ones the server evicts at its cap
    deadline = time.monotonic() + 10
    while not latencies and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(15)


def test_a_64_mib_content_length_is_refused_before_the_body_is_read(limited):
    with connect(limited.port, timeout_s=5) as sock:
        start = time.monotonic()
        sock.sendall(HEAD_64_MIB)
        response = read_until_closed(sock)  # answered and closed without waiting for the body
        took = time.monotonic() - start
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    error = json_body(response)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "server.max_request_body_bytes" in error["message"]
    assert took < 2.0


def test_a_client_still_sending_a_large_body_reads_the_413(limited):
    """httpx posts twice the limit with a Content-Length: the server answers 413 before
    reading the body and closes while the client is still sending it. The close lingers, so
    every post gets the 413 rather than a reset connection."""
    outcomes = []
    for _ in range(12):
        try:
            outcomes.append(httpx.post(f"{limited.url}/v1/completions", content=b"x" * (2 * BODY_LIMIT),
                                       headers={"content-type": "application/json"},
                                       timeout=10).status_code)
        except httpx.HTTPError as exc:
            outcomes.append(repr(exc))
    assert outcomes == [413] * 12, outcomes


def test_a_chunked_body_is_cut_off_at_the_limit_while_health_answers(limited):
    """No Content-Length: the body is counted as it is read; the first chunk past the limit
    ends the request. The client sends one byte more than the limit and no end of body, so a
    server that waited for the whole body would never answer."""
    with health_timer(limited.url) as latencies, connect(limited.port) as sock:
        send_chunked(sock, "/v1/completions", BODY_LIMIT + 1)
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    assert json_body(response)["error"]["code"] == "request_too_large"
    assert latencies and max(latencies) < HEALTH_BOUND_S, latencies


def test_a_body_under_the_limit_is_served(limited):
    padding = " " * (BODY_LIMIT - 200)  # JSON whitespace: a body just under the limit
    body = ('{"prompt": "def f(x):", "max_tokens": 2%s}' % padding).encode()
    assert len(body) < BODY_LIMIT
    response = httpx.post(f"{limited.url}/v1/completions", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["completion_tokens"] == 2


def test_long_prompts_are_tokenized_while_health_answers(limited, hf_tokenizer):
    """Two requests of 500,000 characters of prompt each (under the body and character limits),
    tokenized at the same time: /health keeps answering, and each gets the 400 its token count
    (HF's tokenizer's) earns on a 512-token context."""
    text = ("def f(x): return x + 1  # hello world\n" * 13500)[:500_000]
    want = len(hf_tokenizer.encode(text))
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(httpx.post(f"{limited.url}/v1/completions", json={"prompt": text}, timeout=120))

    senders = [threading.Thread(target=send) for _ in range(2)]
    with health_timer(limited.url) as latencies:
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
    assert [r.status_code for r in results] == [400, 400], [r.text[:300] for r in results]
    for response in results:
        error = response.json()["error"]
        assert error["param"] == "max_tokens" and f"the prompt ({want} tokens)" in error["message"], error
    assert len(latencies) >= 5 and max(latencies) < HEALTH_BOUND_S, str([round(t, 2) for t in latencies])


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _is_closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (which it sent nothing)."""
    sock.settimeout(0.0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_slow_request_heads_are_closed_at_the_header_timeout(limited):
    """A head that trickles in a byte every 0.1 s is answered 408 and closed, and a connection
    that sends nothing is closed, both within the header timeout plus scheduling slack."""
    idle = connect(limited.port, timeout_s=HEADER_TIMEOUT_S + 5)
    slow = connect(limited.port, timeout_s=HEADER_TIMEOUT_S + 5)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    start = time.monotonic()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            try:
                slow.sendall(b"a")
            except OSError:
                return

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        answer = read_until_closed(slow)
        slow_took = time.monotonic() - start
        assert read_until_closed(idle) == b""
        idle_took = time.monotonic() - start
    finally:
        stop.set()
        trickler.join(5)
        idle.close()
        slow.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert slow_took < HEADER_TIMEOUT_S + 2 and idle_took < HEADER_TIMEOUT_S + 2, (slow_took, idle_took)


_TRICKLING_CLIENTS = """
import json, socket, sys, threading
port, count, timeout_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
socks = [socket.create_connection(("127.0.0.1", port), timeout=timeout_s) for _ in range(count)]
for sock in socks:
    sock.sendall(b"POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\nX-Slow: ")
stop = threading.Event()
def trickle(sock):
    while not stop.wait(0.0005):
        try:
            sock.sendall(b"a")
        except OSError:
            return
threads = [threading.Thread(target=trickle, args=(s,), daemon=True) for s in socks]
for t in threads:
    t.start()
answers = []
for sock in socks:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        answers.append(data.decode("latin-1"))
    except OSError as exc:
        answers.append(repr(exc))
stop.set()
print(json.dumps(answers))
"""


def test_a_408_survives_bytes_the_client_sends_around_it(limited):
    """Clients (another process, so their bytes race the server's close) keep sending header
    bytes every half millisecond across the deadline: each still reads the whole 408 and then
    an orderly end. A plain close with a late byte unread in the server's socket sends a TCP
    reset instead of a FIN, and the client's next read fails with ECONNRESET; the server
    closes lingeringly (its write side first, late bytes read and dropped)."""
    run = subprocess.run([sys.executable, "-c", _TRICKLING_CLIENTS, str(limited.port), "16",
                          str(HEADER_TIMEOUT_S + 5)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    answers = json.loads(run.stdout)
    bad = [a for a in answers if not a.startswith("HTTP/1.1 408 ")]
    assert len(answers) == 16 and not bad, bad


def test_hundreds_of_half_open_sockets_leave_health_answering(model_dir):
    """Five times ``max_connections`` half-open sockets, opened faster than the (default)
    header timeout ends them: the server keeps at most the cap open, evicting the oldest
    half-open ones, /health answers meanwhile, and a request is served."""
    socks: list[socket.socket] = []
    with running_server(server_config(model_dir, max_connections=MAX_CONNECTIONS)) as srv:
        state = srv.server.server_state
        try:
            with health_timer(srv.url) as latencies:
                for _ in range(5 * MAX_CONNECTIONS):
                    sock = connect(srv.port)
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
                    socks.append(sock)
                assert _wait_until(lambda: len(state.connections) <= MAX_CONNECTIONS, 5), \
                    len(state.connections)
                response = httpx.post(f"{srv.url}/v1/completions", timeout=30,
                                      json={"prompt": "x = 1", "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert latencies and max(latencies) < HEALTH_BOUND_S, latencies
            evicted = sum(_is_closed(s) for s in socks)
            assert evicted >= 4 * MAX_CONNECTIONS, evicted
        finally:
            for sock in socks:
                sock.close()


async def _ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_connection_whose_whole_head_is_unread_is_not_evicted_as_half_open():
    """The event loop accepts a burst of connections before it reads any of them, so a client
    whose complete request head is waiting in its socket can be the oldest "waiting" one when
    half-open sockets pass the cap. Here the first connection's reading is held (as a busy loop
    holds it) while eight half-open sockets arrive with a cap of four: the three other oldest
    waiting ones are evicted instead, and once reading resumes the held client is answered."""
    base = limited_h11_protocol(ServerConfig(max_connections=4))
    held: list = []
    arm = threading.Event()

    class HeldFirst(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if arm.is_set() and not held:
                self.transport.pause_reading()
                held.append(self)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_ok_app, http=HeldFirst, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    socks: list[socket.socket] = []
    try:
        assert _wait_until(lambda: server.started, 10)
        arm.set()
        with connect(port) as probe:
            probe.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _wait_until(lambda: bool(held), 5)
            for _ in range(8):
                sock = connect(port)
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
                socks.append(sock)
            evicted = lambda: sum(_is_closed(s) for s in socks)  # noqa: E731
            assert _wait_until(lambda: evicted() >= 8 - 3, 5), evicted()
            loop = held[0].loop
            loop.call_soon_threadsafe(held[0].transport.resume_reading)
            answer = probe.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert evicted() == 8 - 3 and len(server.server_state.connections) <= 4
    finally:
        for sock in socks:
            sock.close()
        server.should_exit = True
        thread.join(30)
