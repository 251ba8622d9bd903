"""HTTP hardening shared by the instance and the router: a request-body limit checked while the
body is read, and uvicorn's h11 protocol with a request-head timeout and a connection cap.

What each knob (``[server]``) does, and which layer does it:

- ``max_request_body_bytes``: ``BodyLimitMiddleware`` (ASGI). A Content-Length above it is a 413
  before a byte of the body is read; a body without one (chunked) is counted chunk by chunk as
  the app reads it, and the first chunk past the limit ends the request with a 413. Either way
  the connection is closed, so the rest of the body is never read.
- ``header_timeout_s``: ``LimitedH11Protocol``. A connection gets this long, from the moment it
  opens and again after each response, to send a complete request head; then it is answered
  408 and closed. uvicorn's own ``timeout_keep_alive`` is cancelled by any byte received, so a
  client sending a header byte now and then would otherwise hold its connection forever.
- ``keep_alive_timeout_s``: uvicorn's ``timeout_keep_alive``: an idle connection that sends
  nothing after a response is closed.
- ``max_connections``: ``LimitedH11Protocol``. Past it, a new connection evicts the oldest one
  still waiting for its request head (slow or half-open sockets), so /health keeps answering;
  when every connection has a request in flight the new one is closed at once. A connection
  whose complete head already sits unread in its socket is not half-open (the event loop
  accepts connections in batches, before it reads any of them) and is passed over. uvicorn's
  ``limit_concurrency`` is left unset: it counts open connections too and answers 503 to every
  request past it, /health included, so half-open sockets would make the instance look down.

Every close while the client may still be sending (after a 408, or a 413 with the body unread)
lingers, as nginx's ``lingering_close`` does: the write side is shut first, late bytes are read
and dropped for up to ``LINGER_S``, then the socket closes (``_LingeringTransport``). A plain
close would answer those bytes with a TCP reset, and a client's HTTP library (httpx included)
then reports a broken connection instead of the 408 or 413.
"""
from __future__ import annotations

import asyncio
import heapq
import json
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.config import ServerConfig

_TIMEOUT_BODY = b"the request head did not arrive in time"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
LINGER_S = 2.0
_EVICTION_CANDIDATES = 8  # the oldest waiting connections looked into for an unread head
_HEAD_PEEK_BYTES = 16 * 1024  # h11's default limit on a request head


class _BodyTooLarge(Exception):
    """The body read so far exceeds the limit."""


class BodyLimitMiddleware:
    """A 413 with an OpenAI-style error body for a request whose body exceeds ``max_bytes``,
    decided from Content-Length up front or while the body is read; nothing past the limit is
    buffered, and the connection is closed after the answer."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"declares {declared} bytes")
            return
        state = {"read": 0, "too_large": False, "started": False}

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["read"] += len(message.get("body", b""))
                if state["read"] > self.max_bytes:
                    state["too_large"] = True
                    raise _BodyTooLarge()
            return message

        async def guarded_send(message) -> None:
            if state["too_large"]:
                return  # the app's own answer to the exception is replaced by the 413 below
            state["started"] = state["started"] or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if state["too_large"] and not state["started"]:
            await self._refuse(send, f"has more than {self.max_bytes} bytes")

    async def _refuse(self, send, what: str) -> None:
        body = json.dumps({"error": {
            "message": f"the request body {what}; the limit is {self.max_bytes} bytes "
                       "(server.max_request_body_bytes)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 has refused it already
    return None


class _LingeringTransport:
    """A connection's transport whose ``close`` lingers while the client may still be sending
    (a partial request head, or a request body the server did not read): the write side is shut
    once the answer is flushed, what still arrives is read and dropped (``LimitedH11Protocol.
    data_received``), and the socket closes at the client's EOF or after ``LINGER_S``. A plain
    close with unread bytes, or bytes arriving after it, draws a TCP reset, which can destroy
    the answer (a 408 or 413) before the client reads it. Everything else is the transport's."""

    def __init__(self, transport, protocol: LimitedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._transport.is_closing() or self._protocol.lingering

    def close(self) -> None:
        protocol, transport = self._protocol, self._transport
        if protocol.lingering or transport.is_closing():
            self.close_now()
        elif protocol.client_may_be_sending() and transport.can_write_eof():
            transport.write_eof()  # sent once what is buffered is flushed
            protocol.flow.resume_reading()  # uvicorn pauses reading on a body the app left
            protocol._linger = protocol.loop.call_later(LINGER_S, self.close_now)
        else:
            transport.close()

    def close_now(self) -> None:
        """Close without lingering (buffered output is still flushed first)."""
        if self._protocol._linger is not None:
            self._protocol._linger.cancel()
            self._protocol._linger = None
        self._transport.close()


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline, a cap on open connections and
    lingering closes (see the module docstring). Configured by subclassing:
    ``limited_h11_protocol``."""

    header_timeout_s: float = 10.0
    max_connections: int = 1000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = _LingeringTransport(self.transport, self)
        self._await_head()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc) -> None:
        self._head_arrived()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # answered and half-closed: drop what is still coming
        super().data_received(data)
        if self._head_deadline is not None and self.conn.their_state is not h11.IDLE:
            self._head_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()

    @property
    def lingering(self) -> bool:
        return self._linger is not None

    @property
    def waiting_for_head(self) -> bool:
        """Waiting for a request head, or lingering after an answer (evictable either way)."""
        return self._head_deadline is not None or self._linger is not None

    def client_may_be_sending(self) -> bool:
        """A request body the server has not read to its end, or a partial request head."""
        their = self.conn.their_state
        return their is h11.SEND_BODY or (their is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _await_head(self) -> None:
        self._head_arrived()
        self._waiting_since = self.loop.time()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_arrived(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_TIMEOUT_RESPONSE)  # a partial head: say why
        self.transport.close()

    def _make_room(self) -> None:
        """Close the oldest connection waiting for its head, passing over those whose complete
        head is already in their socket (of the ``_EVICTION_CANDIDATES`` oldest), or this one
        if none is waiting."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, LimitedH11Protocol) and c.waiting_for_head]
        oldest = heapq.nsmallest(_EVICTION_CANDIDATES, idle, key=lambda c: c._waiting_since)
        victim = next((c for c in oldest if not c._head_unread()), oldest[0] if oldest else self)
        victim._head_arrived()
        victim.transport.close_now()

    def _head_unread(self) -> bool:
        """Whether a complete request head has arrived on this connection but is not read yet
        (a peek at the socket: nothing is consumed)."""
        if self._linger is not None:
            return False
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return False
        try:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as peer:
                unread = peer.recv(_HEAD_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return False
        return b"\r\n\r\n" in bytes(self.conn.trailing_data[0]) + unread


def limited_h11_protocol(server: ServerConfig) -> type[LimitedH11Protocol]:
    """``LimitedH11Protocol`` with ``server``'s head timeout and connection cap."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {
        "header_timeout_s": server.header_timeout_s, "max_connections": server.max_connections})


def uvicorn_config(app, server: ServerConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` under ``server``'s connection limits (``kwargs``: the rest,
    e.g. host, port, log_level)."""
    return uvicorn.Config(app, http=limited_h11_protocol(server),
                          timeout_keep_alive=server.keep_alive_timeout_s, **kwargs)
