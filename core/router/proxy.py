"""One HTTP exchange between the router and an instance.

- ``post``: the whole answer of a request that is not streamed.
- ``open_stream``: a streamed request read up to its first token. The events read so far are
  held back (``OpenedStream.head``); nothing has reached the client yet, so a failure up to that
  point can be retried on another instance. The rest is read as the client consumes it.
- ``RelayedStream``: the client's SSE response; its ``on_close`` runs however it ends (finished,
  client gone, cancelled, never started), which is where the upstream stream is closed, so an
  instance sees a client's disconnect as its own and aborts the request.

Both raise ``Unreachable`` when the instance cannot be reached, the connection breaks before it
answered, or it sent nothing for the client's read timeout (``timed_out``: a frozen instance).
Events are relayed unchanged.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import Response
from starlette.responses import StreamingResponse

SSE_DONE = "data: [DONE]\n\n"
RawHeaders = list[tuple[bytes, bytes]]
"""Headers relayed from the client: raw names and values."""
_RELAYED_HEADERS = ("content-type", "retry-after")


class Unreachable(Exception):
    """No answer from ``url``. ``connected``: the request may have reached the instance (the
    connection broke after it was sent), as opposed to a connection that never opened."""

    def __init__(self, url: str, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.url = url
        self.connected = not isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout,
                                              httpx.PoolTimeout))
        self.timed_out = timed_out(exc)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a read or write timeout: the instance took the request and went silent."""
    return isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout))


@dataclass(slots=True)
class Answer:
    """A complete HTTP answer of an instance."""

    status: int
    content: bytes
    headers: httpx.Headers

    def json(self) -> Any:
        """The body as JSON; None when it is not JSON."""
        try:
            return json.loads(self.content)
        except ValueError:
            return None

    def response(self) -> Response:
        """The answer, relayed to the client unchanged."""
        headers = {k: self.headers[k] for k in _RELAYED_HEADERS if k in self.headers}
        return Response(self.content, status_code=self.status, headers=headers)


async def post(client: httpx.AsyncClient, url: str, body: dict, headers: RawHeaders) -> Answer:
    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.TransportError as exc:
        raise Unreachable(url, exc) from exc
    return Answer(response.status_code, response.content, response.headers)


@dataclass(slots=True)
class OpenedStream:
    """A 200 SSE stream read up to its first visible event: ``head`` (not yet relayed), then
    ``rest`` (raises ``httpx.TransportError`` if the connection breaks)."""

    response: httpx.Response
    head: list[str]
    rest: AsyncIterator[str]

    async def close(self, drain_s: float = 0.0) -> None:
        """Close the upstream response. With ``drain_s`` (the stream reached its ``[DONE]``),
        first read what is left of the body for at most that long, so that the connection goes
        back to the pool instead of being closed: a closed connection is a new one per request
        and a socket in TIME_WAIT on the router for each. Without it (the client left, the
        stream broke), closing is what tells the instance to abort."""
        if drain_s > 0:
            try:
                await asyncio.wait_for(_drain(self.rest), drain_s)
            except (asyncio.TimeoutError, httpx.TransportError):
                pass  # an instance that died or froze after its [DONE]: just close
        await self.rest.aclose()
        await self.response.aclose()


async def _drain(events: AsyncIterator[str]) -> None:
    async for _ in events:
        pass


async def open_stream(client: httpx.AsyncClient, url: str, body: dict,
                      headers: RawHeaders) -> Answer | OpenedStream:
    """POST a streamed request; a non-200 status is returned as a whole ``Answer``."""
    request = client.build_request("POST", url, json=body, headers=headers)
    try:
        response = await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise Unreachable(url, exc) from exc
    opened = None
    try:
        if response.status_code != 200:
            return Answer(response.status_code, await response.aread(), response.headers)
        events = sse_events(response)
        head: list[str] = []
        async for event in events:
            head.append(event)
            if is_visible(event):
                opened = OpenedStream(response, head, events)
                return opened
        raise Unreachable(url, httpx.RemoteProtocolError("the stream ended before its first token"))
    except httpx.TransportError as exc:
        raise Unreachable(url, exc) from exc
    finally:
        if opened is None:
            await response.aclose()


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The server-sent events of ``response``, each as its text plus the blank line ending it."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield "\n".join(lines) + "\n\n"
            lines = []
    if lines:
        yield "\n".join(lines) + "\n\n"


def is_done(event: str) -> bool:
    """Whether an event is the end of an OpenAI stream, ``data: [DONE]``."""
    return any(line[len("data:"):].strip() == "[DONE]"
               for line in event.splitlines() if line.startswith("data:"))


def is_visible(event: str) -> bool:
    """Whether an event is one the client must see: it carries text or a finish reason, an
    error, a usage summary or the end of the stream. Only a chunk with choices and none of
    those (a chat stream's opening role delta) is not."""
    for line in event.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        try:
            chunk = json.loads(data)
        except ValueError:
            return True  # "[DONE]", or something only the client can judge
        if not isinstance(chunk, dict) or "error" in chunk:
            return True
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return True
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content") or choice.get("finish_reason"):
                return True
    return False


class RelayedStream(StreamingResponse):
    """An SSE response relayed from an instance; ``on_close`` runs once, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._on_close()
