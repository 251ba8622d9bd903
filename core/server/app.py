"""The FastAPI app of one tandem instance: the OpenAI routes, vLLM's /tokenize and /detokenize,
/health, /metrics, /version, and the KV hand-over routes of a prefill instance (/kv/handshake,
/kv/release; see tandem.server.disagg).

``create_app(config)`` builds everything an instance needs (the async engine, its metrics) and
starts the engine in the app's lifespan: the model loads in the engine thread while the server
already answers /health with 503. Every /v1 route, /tokenize and /detokenize need
``Authorization: Bearer KEY`` when ``server.api_key`` is set; requests with ``kv_transfer_params`` and the /kv routes need the
cluster secret (``X-Tandem-KV-Secret``) when ``disaggregation.kv_transfer_secret`` is set. A body
past ``server.max_request_body_bytes`` is a 413 (``tandem.http_limits``). Errors use
OpenAI's body; FastAPI's 422 becomes a 400; a 500 names an error id, never the exception's text
(the log has it under that id). A prefill or decode instance refuses to start without the
cluster secret (``tandem.config.require_cluster_secret``).
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem import __version__
from tandem.async_engine import AsyncEngine, EngineState, QueueLimits
from tandem.errors import EngineError, EngineUnavailable
from tandem.config import Role, TandemConfig, require_cluster_secret
from tandem.engine import LLMEngine
from tandem.interfaces import ToolParser
from tandem.plugin_manager import get_registry
from tandem.server.bounds import RequestBounds
from tandem.server.chat import create_chat_completion
from tandem.server.completions import create_completion
from tandem.server.disagg import (HANDSHAKE_PATH, KV_EVENTS_PATH, KV_SECRET_HEADER, PROGRESS_PATH, RELEASE_PATH,
                                  RESET_PREFIX_CACHE_PATH, HandshakeCache, check_kv_secret)
from tandem.server.kv_progress import progress_answer
from tandem.server.errors import APIError, api_error_from, internal_error
from tandem.http_limits import BodyLimitMiddleware
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    KVReleaseRequest,
    KVReleaseResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from tandem.server.serving import ClientDisconnected, ServingContext
from tandem.server.tokenize import detokenize, tokenize

logger = logging.getLogger("tandem.server")

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 500, 503)}
_KV_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 503)}


def create_app(config: TandemConfig, engine_factory: Callable[[], LLMEngine] | None = None) -> FastAPI:
    """The app serving ``config.model.path`` (which must be set). ``engine_factory`` replaces
    ``LLMEngine(config)``, to wrap the engine (tests inject faults this way)."""
    assert config.model.path is not None, "resolve the model path before building the app"
    require_cluster_secret(config, f"a {config.disaggregation.role} instance")
    metrics = ServerMetrics()
    engine = AsyncEngine(
        engine_factory or (lambda: LLMEngine(config)),
        QueueLimits(config.server.max_queued_requests, config.server.max_queued_tokens),
        step_listener=metrics.observe_step,
    )
    metrics.track(lambda: engine.snapshot)
    secret = config.disaggregation.kv_transfer_secret
    kv_secret = secret.get_secret_value() if secret is not None else None
    ctx = ServingContext(engine, config.model.served_model_name or config.model.path,
                         config.model.path, metrics, config.server.log_requests,
                         config.server.stream_stall_timeout_s, kv_secret,
                         HandshakeCache(secret=kv_secret), _auto_tool_parser(config),
                         RequestBounds.of(config.server))
    role = config.disaggregation.role
    if role is not Role.BOTH and kv_secret is None:
        logger.warning("disaggregation.role is %s and disaggregation.kv_transfer_secret is unset "
                       "(allow_insecure_no_secret): anyone who can reach this instance can drive its "
                       "KV hand-overs (pin its blocks, read them, make it fetch a URL)", role)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        await engine.shutdown(config.server.shutdown_timeout_s)

    app = FastAPI(title="tandem", version=__version__, lifespan=lifespan,
                  description="An OpenAI-compatible LLM inference server.")
    app.state.tandem = ctx
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_request_body_bytes)
    _add_error_handlers(app, metrics)
    app.include_router(_v1_router(ctx, config.server.api_key))
    app.include_router(_tokenizer_router(ctx, config.server.api_key))
    _add_operator_routes(app, ctx)
    _add_kv_routes(app, ctx)
    return app


def _auto_tool_parser(config: TandemConfig) -> ToolParser | None:
    """The parser of tool_choice "auto", when the server serves it (UnknownPluginError for a
    name no plugin registered)."""
    if not config.server.enable_auto_tool_choice:
        return None
    return get_registry().get("tool_parser", config.server.tool_call_parser)()


def _api_key_check(api_key: SecretStr | None) -> Callable[[Request], Awaitable[None]]:
    expected = None if api_key is None else f"Bearer {api_key.get_secret_value()}".encode()

    async def check_api_key(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode("latin-1")
        if not hmac.compare_digest(given, expected):
            raise APIError(401, "a valid API key is required: Authorization: Bearer KEY",
                           code="invalid_api_key")

    return check_api_key


def _model_card(ctx: ServingContext) -> ModelCard:
    return ModelCard(id=ctx.model_name, root=ctx.model_path, max_model_len=ctx.engine.max_model_len)


def _v1_router(ctx: ServingContext, api_key: SecretStr | None) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_api_key_check(api_key))], responses=_ERRORS)

    @router.get("/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(ctx)])

    @router.get("/models/{model_id:path}", response_model=ModelCard)
    async def retrieve_model(model_id: str) -> ModelCard:
        """The model ``model_id`` as /v1/models lists it; 404 (model_not_found) for another id."""
        ctx.check_model(model_id)
        return _model_card(ctx)

    @router.post("/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI completions; with ``stream`` the answer is text/event-stream chunks."""
        return await create_completion(ctx, body, request)

    @router.post("/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completions through the model's chat template."""
        return await create_chat_completion(ctx, body, request)

    return router


def _tokenizer_router(ctx: ServingContext, api_key: SecretStr | None) -> APIRouter:
    """vLLM's /tokenize and /detokenize, guarded by the API key as the /v1 routes are."""
    router = APIRouter(dependencies=[Depends(_api_key_check(api_key))], responses=_ERRORS)

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        """A prompt (as /v1/completions tokenizes it) or messages (through the chat template)
        to token ids, with the context length."""
        return await tokenize(ctx, body)

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        """Token ids to text."""
        return await detokenize(ctx, body)

    return router


def _add_operator_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when ready to serve; 503 while loading, shutting down or failed."""
        state = ctx.engine.state
        status = 200 if state == EngineState.READY else 503
        return JSONResponse({"status": state.value}, status_code=status)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _add_kv_routes(app: FastAPI, ctx: ServingContext) -> None:
    def check(request: Request) -> None:
        check_kv_secret(ctx.kv_secret, request)

    def require_connector() -> None:
        if not ctx.engine.has_kv_connector:
            raise APIError(404, "this instance is colocated (disaggregation.role = both): it has no "
                                "KV connector", code="not_found")

    @app.get(HANDSHAKE_PATH, dependencies=[Depends(check)], responses=_KV_ERRORS)
    async def kv_handshake() -> JSONResponse:
        """What a decode instance needs to read this prefill instance's KV blocks: the KV
        connector's handshake plus this engine's id. 503 until ready; 404 when colocated."""
        ctx.check_ready()
        require_connector()
        return JSONResponse(ctx.engine.kv_handshake())

    @app.get(KV_EVENTS_PATH, dependencies=[Depends(check)], responses=_KV_ERRORS)
    async def kv_events() -> JSONResponse:
        """Where this instance publishes its KV events (``kv_events``): the PUB and replay
        endpoints as bound, the topic and the block size. 503 until ready; 404 when off."""
        ctx.check_ready()
        info = ctx.engine.kv_events_info()
        if info is None:
            raise APIError(404, "this instance publishes no KV events (kv_events.enabled = false)",
                           code="not_found")
        return JSONResponse(info)

    @app.get(PROGRESS_PATH, dependencies=[Depends(check)], responses=_KV_ERRORS)
    async def kv_progress(transfer_id: str = Query(min_length=1, max_length=512),
                          known: int = Query(0, ge=0, le=1 << 20)) -> JSONResponse:
        """A streamed hand-over's latest announcement (``tandem.server.kv_progress``): once it
        lists more than ``known`` blocks or has ended, else after a second as it is. 404 for
        a transfer this instance does not stream, or when colocated."""
        require_connector()
        return await progress_answer(ctx, transfer_id, known)

    @app.post(RESET_PREFIX_CACHE_PATH, dependencies=[Depends(check)], responses=_KV_ERRORS,
              response_model=ResetPrefixCacheResponse)
    async def reset_prefix_cache() -> ResetPrefixCacheResponse:
        """Forget every cached prompt block no running request holds (vLLM's endpoint of the
        same name; with ``kv_events`` on, subscribers see ``AllBlocksCleared``). An operator's
        action: it needs the cluster secret, and is refused (403) on an instance without one
        unless disaggregation.allow_insecure_no_secret opened every KV route."""
        if ctx.kv_secret is None and not ctx.engine.has_kv_connector:
            raise APIError(403, f"{RESET_PREFIX_CACHE_PATH} is closed on an instance without "
                                "disaggregation.kv_transfer_secret (send it in the header "
                                f"{KV_SECRET_HEADER})", code="forbidden")
        try:
            forgotten = await ctx.engine.reset_prefix_cache()
        except (EngineUnavailable, EngineError) as exc:
            raise api_error_from(exc) from exc
        return ResetPrefixCacheResponse(num_blocks_forgotten=forgotten)

    @app.post(RELEASE_PATH, dependencies=[Depends(check)], responses=_KV_ERRORS,
              response_model=KVReleaseResponse)
    async def kv_release(body: KVReleaseRequest) -> KVReleaseResponse:
        """Release the blocks pinned for ``transfer_id`` now, instead of at kv_expiry_s: the
        router sends it when no decode instance took the hand-over. ``released`` is false when
        no such pin is held (read, released or expired already). 404 when colocated."""
        if ctx.engine.model_path is None:
            ctx.check_ready()
        require_connector()
        try:
            released = await ctx.engine.release_kv_transfer(body.transfer_id)
        except (EngineUnavailable, EngineError) as exc:
            raise api_error_from(exc) from exc
        return KVReleaseResponse(transfer_id=body.transfer_id, released=released)


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def answer(error: APIError) -> JSONResponse:
        metrics.record_error(error.code)
        return error.response()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return answer(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = "the request body is not valid UTF-8"
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return answer(APIError(exc.status_code, message, code=code))

    @app.exception_handler(ClientDisconnected)
    async def disconnected(request: Request, exc: ClientDisconnected) -> Response:
        metrics.record_error("client_disconnected")
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unhandled_error(request: Request, exc: Exception) -> JSONResponse:
        """A bug: the client gets an error id, the log the exception under it."""
        return answer(internal_error(exc, f"internal error in {request.method} {request.url.path}",
                                     "internal_error"))


_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def _validation_error(exc: RequestValidationError) -> APIError:
    """One 400 naming every bad field (or the JSON syntax error)."""
    problems: dict[str, str] = {}
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", "")
            return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "),
                            code="invalid_json")
        if not loc:
            return APIError(400, "the request body must be a JSON object", code="invalid_json")
        tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
        if tag is None:
            problems.setdefault(".".join(loc), err.get("msg", "invalid value"))
        else:  # pydantic tried every member of a union: name the accepted forms once
            path = ".".join(loc[:tag])
            problems[path] = f"must be {_FORMS.get(loc[tag - 1], 'one of the accepted types')}"
    message = "; ".join(f"{path}: {msg}" for path, msg in problems.items())
    return APIError(400, message, param=next(iter(problems)).split(".")[0])


def _is_union_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()
