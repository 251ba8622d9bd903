"""Raw-socket HTTP/1.1 clients for the connection-limit tests: what a slow or hostile client
sends, byte by byte, which httpx will not do."""
from __future__ import annotations

import json
import socket

HEAD_64_MIB = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % (64 * 1024 * 1024))
"""A request head declaring a 64 MiB body (the body itself is never sent)."""


def connect(port: int, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a read timeout raises)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def json_body(response: bytes) -> dict:
    """The JSON body of a raw response (not chunked)."""
    return json.loads(response.partition(b"\r\n\r\n")[2])


def send_chunked(sock: socket.socket, path: str, num_bytes: int) -> None:
    """A POST whose chunked body holds ``num_bytes`` bytes and no end: a server that waited
    for the whole body would never answer."""
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" % path.encode())
    chunk = b"x" * (256 * 1024)
    sent = 0
    while sent < num_bytes:
        piece = chunk[:num_bytes - sent]
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sent += len(piece)
