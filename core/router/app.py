"""The router's FastAPI app.

    POST /v1/completions, /v1/chat/completions   routed (dispatch.py); streams relayed unchanged
    GET  /v1/models, /v1/models/{id}             relayed from a healthy instance (an id that
                                                 could name another route is a 400: model_ids.py)
    POST /tokenize, /detokenize                  relayed to a healthy instance
    /health, /version, /metrics, /admin/*        the router's own (admin.py)

Nothing else reaches an instance: the router relays only these public routes. The /v1 routes,
/tokenize and /detokenize need ``Authorization: Bearer <server.api_key>`` when that key is set;
the header is relayed to the instances byte for byte. A client that goes away before its answer
is ready cancels the upstream requests (the instances abort them). Upstream requests time out
(``disaggregation.upstream_connect_timeout_s``, and ``upstream_timeout_s`` per read: between
two chunks of a stream, not for the whole generation).

A router over prefill or decode instances refuses to start without the cluster secret
(``tandem.config.require_cluster_secret``).

A body is relayed only when it is a JSON object that can be sent on as it came (RFC 8259: no NaN
or Infinity; strings of Unicode characters, not lone UTF-16 surrogates); anything else is the
client's 400, answered here. Client input never gets a 5xx from the router itself: a 5xx is an
instance's answer, relayed, or an upstream failure (dispatch.py); a bug's 500 names an error id,
never the exception's text (the log has it).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr

from tandem import __version__
from tandem.config import DisaggregationConfig, TandemConfig, require_cluster_secret
from tandem.plugin_manager import get_registry
from tandem.router.admin import add_operator_routes, admin_routes
from tandem.router.auth import bearer_check
from tandem.router.dispatch import Dispatcher, RouterRequest
from tandem.router.errors import RouterError
from tandem.router.metrics import RouterMetrics
from tandem.router.model_ids import is_valid_model_id
from tandem.router.prompts import PromptInfo, chat_prompt, completion_prompt
from tandem.router.proxy import RawHeaders, timed_out
from tandem.router.registry import InstanceRegistry, Step
from tandem.http_limits import BodyLimitMiddleware

logger = logging.getLogger("tandem.router")

UPSTREAM_WRITE_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 2.0
_RELAYED_HEADERS = (b"authorization",)


def create_router_app(config: TandemConfig, health_interval_s: float = 1.0) -> FastAPI:
    """The router over ``config.disaggregation.instances``, checking their health every
    ``health_interval_s`` seconds. The routing policies are built from the installed plugins."""
    require_cluster_secret(config, "the router over prefill and decode instances")
    disagg = config.disaggregation
    registry = InstanceRegistry([(i.url, i.role) for i in disagg.instances])
    metrics = RouterMetrics(registry)
    plugins = get_registry()
    client = httpx.AsyncClient(timeout=upstream_timeout(disagg), trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    health_client = httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S, trust_env=False)
    secret = disagg.kv_transfer_secret
    dispatcher = Dispatcher(registry, plugins.get("routing_policy", disagg.routing_policy)(),
                            plugins.get("routing_policy", disagg.decode_routing_policy)(),
                            metrics, client, disagg.min_disaggregated_prompt_tokens,
                            secret.get_secret_value() if secret is not None else None,
                            disagg.min_uncached_prefill_tokens)

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
            dispatcher.close()
            await client.aclose()
            await health_client.aclose()

    app = FastAPI(title="tandem router", version=__version__, lifespan=lifespan,
                  description="Routes OpenAI requests over prefill and decode instances.")
    app.state.dispatcher = dispatcher
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_request_body_bytes)
    _add_error_handlers(app)
    app.include_router(_v1_routes(dispatcher, config.server.api_key))
    app.include_router(_tokenizer_routes(dispatcher, config.server.api_key))
    hand_overs_allowed = secret is not None or disagg.allow_insecure_no_secret
    app.include_router(admin_routes(registry, health_client, disagg.router_admin_key, hand_overs_allowed))
    add_operator_routes(app, registry, metrics, disagg.router_admin_key)
    return app


def upstream_timeout(disagg: DisaggregationConfig) -> httpx.Timeout:
    """Towards instances: connect and read (per read, between bytes) from the config; no pool
    timeout (the pool has no limit)."""
    return httpx.Timeout(connect=disagg.upstream_connect_timeout_s, read=disagg.upstream_timeout_s,
                         write=UPSTREAM_WRITE_TIMEOUT_S, pool=None)


def _v1_routes(dispatcher: Dispatcher, api_key: SecretStr | None) -> APIRouter:
    check = bearer_check(api_key, "a valid API key is required", "invalid_api_key")
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
        if not is_valid_model_id(model_id):
            raise RouterError(400, "invalid model id: segments of letters, digits and _ . - + : @ = ~ "
                                   "separated by /, none of them all dots", code="invalid_model_id",
                              param="model")
        return await relay_to_any(dispatcher, request, f"/v1/models/{quote(model_id, safe='/')}")

    return router


def _tokenizer_routes(dispatcher: Dispatcher, api_key: SecretStr | None) -> APIRouter:
    """/tokenize and /detokenize, relayed to any healthy instance: they all serve one model."""
    check = bearer_check(api_key, "a valid API key is required", "invalid_api_key")
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
    with anything but a 503: GET without ``body``, POST with it. 503 when none does (504 when
    one of them timed out)."""
    headers = _relayed_headers(request)
    registry = dispatcher.registry
    any_timed_out = False
    for info in registry.candidates(Step.DECODE) + registry.candidates(Step.PREFILL):
        try:
            if body is None:
                answer = await dispatcher.client.get(f"{info.url}{path}", headers=headers)
            else:
                answer = await dispatcher.client.post(f"{info.url}{path}", headers=headers, json=body)
        except httpx.TransportError as exc:
            registry.mark_down(info.url, f"{path} failed: {type(exc).__name__}: {exc}")
            any_timed_out |= timed_out(exc)
            continue
        if answer.status_code != 503:
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
    if any_timed_out:
        raise RouterError(504, "no instance answered within disaggregation.upstream_timeout_s",
                          code="upstream_timeout")
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
        """A bug of the router's or of a routing policy plugin's, answered in OpenAI's shape with
        an error id; the exception (its text can hold a prompt or an address) is logged under it."""
        error_id = secrets.token_hex(6)
        logger.error("internal error of the router in %s %s (error id %s)", request.method,
                     request.url.path, error_id, exc_info=exc)
        return RouterError(500, f"internal error of the router (error id {error_id}; the router's "
                                f"log has the details)", code="internal_error").response()
