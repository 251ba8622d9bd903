"""Recording stand-ins for instances, for the router's side of the wire protocol: what it sends
each step, and how it relays what it gets back (including connections that break mid-stream),
which a real colocated instance cannot show yet (it ignores kv_transfer_params). Each answers
/health with 200 and /metrics with idle gauges, records the JSON body of every POST to the /v1
routes (its raw headers and the client's address), and answers it with ``reply(body)``; a POST
to /kv/release is recorded in ``releases`` (body and raw headers) and answered
``{"released": true}``."""
from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tests.server.conftest import ServerThread

IDLE_METRICS = ("tandem:num_requests_running 0.0\ntandem:num_requests_waiting 0.0\n"
                "tandem:kv_cache_usage_perc 0.0\n")

Reply = Callable[[dict], Response]


class FakeInstance:
    def __init__(self, reply: Reply) -> None:
        self.bodies: list[dict] = []
        self.headers: list[list[tuple[bytes, bytes]]] = []
        self.peers: list[tuple[str, int]] = []  # the client address of each POST to /v1
        self.releases: list[tuple[dict, list[tuple[bytes, bytes]]]] = []
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ready"}

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(IDLE_METRICS, media_type="text/plain")

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(list(request.headers.raw))
            self.peers.append((request.client.host, request.client.port))
            return reply(body)

        @app.post("/kv/release")
        async def release(request: Request) -> dict:
            body = await request.json()
            self.releases.append((body, list(request.headers.raw)))
            return {**body, "released": True}

        self.server = ServerThread(app)
        self.url = self.server.url

    def __enter__(self) -> FakeInstance:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()


def json_reply(payload: dict, status: int = 200, headers: dict | None = None) -> Reply:
    return lambda body: JSONResponse(payload, status_code=status, headers=headers)


def sse_reply(events: list[str], break_after: int | None = None) -> Reply:
    """Stream ``events``; with ``break_after`` the connection breaks after that many events
    (the app raises once the response has started, and uvicorn drops the connection without
    ending the chunked body), ``len(events)`` included: after the last one."""

    def reply(body: dict) -> Response:
        async def chunks():
            for index, event in enumerate([*events, None]):
                if index == break_after:
                    raise RuntimeError("the instance died")
                if event is not None:
                    yield event

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return reply


def completion(text: str, **extra) -> dict:
    return {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": "tiny",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length",
                         "stop_reason": None}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}, **extra}


def event(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"
