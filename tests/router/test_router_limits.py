"""The router runs under the same HTTP limits as an instance (``tandem.http_limits``):
a body past ``server.max_request_body_bytes`` is a 413 before it is read through, and a request
head that trickles in is closed at ``server.header_timeout_s``. A real router app under uvicorn
configured as ``tandem router`` configures it; the statuses are stated by hand."""
from __future__ import annotations

import time

import pytest

from tandem.config import load_config
from tandem.router.app import create_router_app
from tests.helpers.raw_http import HEAD_64_MIB, connect, json_body, read_until_closed, send_chunked
from tests.server.server_helpers import ServerThread

BODY_LIMIT = 64 * 1024
HEADER_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def router():
    config = load_config(overrides={"max_request_body_bytes": BODY_LIMIT,
                                    "header_timeout_s": HEADER_TIMEOUT_S}, env={})
    server = ServerThread(create_router_app(config, health_interval_s=0.2), config.server)
    server.start(wait_ready=False)
    try:
        yield server
    finally:
        server.stop()


def test_a_64_mib_content_length_is_a_413_from_the_router(router):
    with connect(router.port, timeout_s=5) as sock:
        sock.sendall(HEAD_64_MIB)
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]
    assert json_body(response)["error"]["code"] == "request_too_large"


def test_a_chunked_body_past_the_limit_is_a_413_from_the_router(router):
    with connect(router.port, timeout_s=5) as sock:
        send_chunked(sock, "/v1/chat/completions", BODY_LIMIT + 1)
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 413 "), response[:200]


def test_a_trickling_request_head_is_closed_by_the_router(router):
    with connect(router.port, timeout_s=HEADER_TIMEOUT_S + 5) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        response = read_until_closed(sock)
        took = time.monotonic() - start
    assert response.startswith(b"HTTP/1.1 408 "), response
    assert took < HEADER_TIMEOUT_S + 2
