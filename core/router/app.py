"""The router's FastAPI app.

    POST /v1/completions, /v1/chat/completions   routed (dispatch.py); streams relayed unchanged
    GET  /v1/models, /v1/models/{id}             relayed from a healthy instance
    POST /tokenize, /detokenize                  relayed to a healthy instance
    GET  /version                                the router's tandem version
    GET  /health                                 200 while a decode-capable instance is in rotation
    GET  /metrics                                the router's metrics (metrics.py)
    GET|POST|DELETE /admin/instances             list, add ({url, role}), remove (?url=...)

The /v1 routes, /tokenize and /detokenize need ``Authorization: Bearer <server.api_key>`` when
that key is set; the header is relayed to the instances byte for byte. The admin routes need ``Authorization: Bearer
<disaggregation.router_admin_key>`` when that key is set (401 otherwise). A client that goes away
before its answer is ready cancels the upstream requests (the instances abort them).

A body is relayed only when it is a JSON object that can be sent on as it came (RFC 8259: no NaN
or Infinity; strings of Unicode characters, not lone UTF-16 surrogates); anything else is the
client's 400, answered here. Client input never gets a 5xx from the router itself: a 5xx is an
instance's answer, relayed, or an upstream failure (dispatch.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tandem import __version__
from tandem.config import InstanceConfig, TandemConfig
from tandem.plugin_manager import get_registry
from tandem.router.dispatch import Dispatcher, RouterRequest
from tandem.router.errors import RouterError
from tandem.router.metrics import RouterMetrics
from tandem.router.prompts import PromptInfo, chat_prompt, completion_prompt
from tandem.router.proxy import RawHeaders
from tandem.router.registry import DuplicateInstance, InstanceRegistry
from tandem.server.http_limits import BodyLimitMiddleware

logger = logging.getLogger("tandem.router")

# Generation can take long: no read timeout towards instances; a dead one breaks the
# connection, and the health checks take a frozen one out of rotation for new requests.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
HEALTH_TIMEOUT_S = 2.0
_RELAYED_HEADERS = (b"authorization",)


def create_router_app(config: TandemConfig, health_interval_s: float = 1.0) -> FastAPI:
    """The router over ``config.disaggregation.instances``, checking their health every
    ``health_interval_s`` seconds. The routing policies are built from the installed plugins."""
    disagg = config.disaggregation
    registry = InstanceRegistry([(i.url, i.role) for i in disagg.instances])
    metrics = RouterMetrics(registry)
    plugins = get_registry()
    client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    health_client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, trust_env=False)
    secret = disagg.kv_transfer_secret
    dispatcher = Dispatcher(registry, plugins.get("routing_policy", disagg.routing_policy)(),
                            plugins.get("routing_policy", disagg.decode_routing_policy)(),
                            metrics, client, disagg.min_disaggregated_prompt_tokens,
                            secret.get_secret_value() if secret is not None else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await registry.check_all(health_client)
        checks = asyncio.ensure_future(registry.run_checks(health_client, health_interval_s))
        try:
            yield
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            await client.aclose()
            await health_client.aclose()

    app = FastAPI(title="tandem router", version=__version__, lifespan=lifespan,
                  description="Routes OpenAI requests over prefill and decode instances.")
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_request_body_bytes)
    _add_error_handlers(app)
    app.include_router(_v1_routes(dispatcher, config.server.api_key))
    app.include_router(_tokenizer_routes(dispatcher, config.server.api_key))
    app.include_router(_admin_routes(registry, health_client, disagg.router_admin_key))
    _add_operator_routes(app, registry, metrics)
    return app


def _bearer_check(key: str | None, what: str, code: str) -> Callable[[Request], Awaitable[None]]:
    async def check(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise RouterError(401, f"{what}: Authorization: Bearer KEY", code=code)

    return check


def _v1_routes(dispatcher: Dispatcher, api_key: str | None) -> APIRouter:
    check = _bearer_check(api_key, "a valid API key is required", "invalid_api_key")
    router = APIRouter(prefix="/v1", dependencies=[Depends(check)])

    async def route(request: Request, path: str, prompt_of: Callable[[dict], PromptInfo]) -> Response:
        arrival = time.monotonic()
        body = json_object(await request.body())
        routed = RouterRequest(path, body, _relayed_headers(request), prompt_of(body), arrival)
        return await _until_disconnect(request, dispatcher.handle(routed))

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        return await route(request, "/v1/completions", completion_prompt)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await route(request, "/v1/chat/completions", chat_prompt)

    @router.get("/models")
    async def models(request: Request) -> Response:
        """The model list of the first healthy instance that answers."""
        return await relay_to_any(dispatcher, request, "/v1/models")

    @router.get("/models/{model_id:path}")
    async def retrieve_model(request: Request, model_id: str) -> Response:
        return await relay_to_any(dispatcher, request, f"/v1/models/{quote(model_id, safe='/')}")

    return router


def _tokenizer_routes(dispatcher: Dispatcher, api_key: str | None) -> APIRouter:
    """/tokenize and /detokenize, relayed to any healthy instance: they all serve one model."""
    check = _bearer_check(api_key, "a valid API key is required", "invalid_api_key")
    router = APIRouter(dependencies=[Depends(check)])

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await relay_to_any(dispatcher, request, "/tokenize", json_object(await request.body()))

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await relay_to_any(dispatcher, request, "/detokenize", json_object(await request.body()))

    return router


async def relay_to_any(dispatcher: Dispatcher, request: Request, path: str,
                       body: dict[str, Any] | None = None) -> Response:
    """The answer of the first healthy instance (decode-capable first) that answers ``path``
    with anything but a 503: GET without ``body``, POST with it. 503 when none does."""
    headers = _relayed_headers(request)
    registry = dispatcher.registry
    for info in registry.candidates("decode") + registry.candidates("prefill"):
        try:
            if body is None:
                answer = await dispatcher.client.get(f"{info.url}{path}", headers=headers)
            else:
                answer = await dispatcher.client.post(f"{info.url}{path}", headers=headers, json=body)
        except httpx.TransportError as exc:
            registry.mark_down(info.url, f"{path} failed: {type(exc).__name__}: {exc}")
            continue
        if answer.status_code != 503:
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
    raise RouterError(503, "no healthy instance answered", code="no_instance")


def _relayed_headers(request: Request) -> RawHeaders:
    """The client's headers that go on to the instances, as the bytes that came (a header value
    is bytes on the wire; decoding it to re-encode it as ASCII would fail on any other byte)."""
    return [(k, v) for k, v in request.headers.raw if k.lower() in _RELAYED_HEADERS]


def json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object that the router can send on; a ``RouterError`` (400)
    naming what is wrong otherwise."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _invalid_json("it is nested too deeply") from None
    except ValueError as exc:  # includes UnicodeDecodeError: bytes that are not UTF-8
        raise _invalid_json(str(exc)) from exc
    if not isinstance(body, dict):
        raise RouterError(400, "the request body must be a JSON object", code="invalid_json")
    try:  # what httpx does to send it: every string must encode to UTF-8
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        raise _invalid_json(f"it has a string that is not valid Unicode ({exc.object[exc.start:exc.end]!r} is "
                            f"half a UTF-16 surrogate pair)") from exc
    except RecursionError:
        raise _invalid_json("it is nested too deeply") from None
    return body


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _invalid_json(reason: str) -> RouterError:
    return RouterError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")


async def _until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """``work``'s response, unless the client goes away first: then ``work`` is cancelled
    (closing its upstream connections, which aborts the instances' requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=499)
    return task.result()


def _admin_routes(registry: InstanceRegistry, health_client: httpx.AsyncClient,
                  admin_key: str | None) -> APIRouter:
    check = _bearer_check(admin_key, "the router's admin key is required", "invalid_admin_key")
    router = APIRouter(prefix="/admin", dependencies=[Depends(check)])

    @router.get("/instances")
    async def list_instances() -> dict:
        return {"instances": [s.as_dict() for s in registry.all()]}

    @router.post("/instances", status_code=201)
    async def add_instance(instance: InstanceConfig) -> dict:
        """Add an instance; it is health-checked at once and in rotation if it answers."""
        try:
            state = registry.add(instance.url, instance.role)
        except DuplicateInstance as exc:
            raise RouterError(409, str(exc), code="instance_exists", param="url") from exc
        except ValueError as exc:
            raise RouterError(400, str(exc), code="invalid_url", param="url") from exc
        await registry.check(state, health_client)
        return state.as_dict()

    @router.delete("/instances")
    async def remove_instance(url: str) -> dict:
        """Remove an instance: no new requests go to it; those in flight finish."""
        try:
            state = registry.remove(url.rstrip("/"))
        except KeyError:
            raise RouterError(404, f"no instance {url} is registered", code="unknown_instance",
                              param="url") from None
        return state.as_dict()

    return router


def _add_operator_routes(app: FastAPI, registry: InstanceRegistry, metrics: RouterMetrics) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one decode-capable instance is in rotation, else 503."""
        ready = bool(registry.candidates("decode"))
        return JSONResponse({"status": "ok" if ready else "no_decode_instance",
                             "instances": [s.as_dict() for s in registry.all()]},
                            status_code=200 if ready else 503)

    @app.get("/version")
    async def version() -> dict:
        """The router's tandem version."""
        return {"version": __version__}

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RouterError)
    async def router_error(request: Request, exc: RouterError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: "
                             f"{e.get('msg', 'invalid value')}" for e in exc.errors())
        return RouterError(400, problems, code="invalid_request").response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug of the router's or of a routing policy plugin's, answered in OpenAI's shape
        (uvicorn logs the traceback)."""
        return RouterError(500, f"internal error of the router: {type(exc).__name__}: {exc}",
                           code="internal_error").response()
