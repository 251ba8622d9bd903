"""What the completions and chat endpoints share: sampling parameters from a request body,
admitting one engine request per prompt in one call (``AsyncEngine.add_requests``, which
checks every prompt first), merging their streams, and aborting them when the client goes away.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from tandem.async_engine import AsyncEngine, RequestBatch, RequestStream, StreamState
from tandem.errors import EngineUnavailable, InvalidRequest
from tandem.interfaces import ToolParser
from tandem.server.disagg import HandshakeCache, KVTransferArgs
from tandem.server.kv_progress import follow_in_background
from tandem.outputs import Logprob, RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.server.bounds import RequestBounds
from tandem.server.errors import APIError, api_error_from, bad_request
from tandem.server.metrics import RequestTimer, ServerMetrics
from tandem.server.protocol import PromptLogprob, PromptLogprobs, SamplingFields
from tandem.server.structured import structured_outputs_of
from tandem.server.validation import UNKNOWN_FIELDS, unknown_fields

logger = logging.getLogger("tandem.server")

T = TypeVar("T")


@dataclass(slots=True)
class ServingContext:
    """What every endpoint needs: the engine, the name it is served under, the metrics."""

    engine: AsyncEngine
    model_name: str
    model_path: str
    metrics: ServerMetrics
    log_requests: bool = False
    stream_stall_timeout_s: float = 60.0
    kv_secret: str | None = None
    """The cluster secret (``disaggregation.kv_transfer_secret``), None when there is none."""
    handshakes: HandshakeCache = field(default_factory=HandshakeCache)
    tool_parser: ToolParser | None = None
    """The parser of tool_choice "auto" (``server.tool_call_parser``); None unless
    ``server.enable_auto_tool_choice``."""
    bounds: RequestBounds = field(default_factory=RequestBounds)
    kv_tasks: set = field(default_factory=set)
    """Background tasks of streamed hand-overs (``tandem.server.kv_progress``), kept referenced."""

    @property
    def tokenizer(self):
        """The event loop's tokenizer (never the engine thread's), for single-token decodes
        while rendering; anything longer goes through ``tokenize``."""
        return self.engine.tokenizer

    async def tokenize(self, fn: Callable[..., T], *args) -> T:
        """``fn(tokenizer, *args)`` on the engine's tokenizer thread (``TokenizerThread``), off
        the event loop."""
        return await self.engine.tokenizer_thread.run(fn, *args)

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"the model {requested!r} does not exist; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")

    def check_ready(self) -> None:
        try:
            self.engine.check_admitting()
        except EngineUnavailable as exc:
            raise api_error_from(exc) from exc


def log_unknown_fields(body: SamplingFields, route: str) -> None:
    """Log the fields of ``body`` that tandem does not know (it ignores them): one line per name
    a minute at most (``tandem.server.validation.UnknownFieldLog``)."""
    names = unknown_fields(body, route)
    if names:
        UNKNOWN_FIELDS.log(route, names)


def request_params(ctx: ServingContext, body: SamplingFields, max_tokens: int | None,
                   logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """``sampling_params`` with this model's defaults (``AsyncEngine.default_sampling``: its
    generation_config.json) for the fields the body leaves out; a value refused is a 400."""
    return sampling_params(body, max_tokens, logprobs, prompt_logprobs,
                           defaults=ctx.engine.default_sampling)


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The engine's parameters for ``body``, ``defaults`` standing in for the sampling fields it
    leaves out; a value SamplingParams refuses is a 400."""
    fields = {
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
    }
    fields = {k: v if v is not None else (defaults or {}).get(k) for k, v in fields.items()}
    structured = structured_outputs_of(body)
    try:
        return SamplingParams(
            n=body.n,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logit_bias=_logit_bias(body.logit_bias),
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            structured_outputs=structured,
            **{k: v for k, v in fields.items() if v is not None},
        )
    except ValueError as exc:
        raise api_error_from(exc) from exc


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None) -> PromptLogprobs | None:
    """An output's prompt logprobs in vLLM's response shape (token ids as JSON keys)."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in entry.items()}
            for entry in entries]


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,12}")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys: decimal strings) keyed by int; another key
    is a 400."""
    if bias is None:
        return None
    bad = next((key for key in bias if not _TOKEN_ID_KEY.fullmatch(key)), None)
    if bad is not None:
        raise bad_request(f"logit_bias keys must be token ids written in decimal, like \"42\" (got "
                          f"{ascii(bad[:32])})", "logit_bias")
    return {int(key): value for key, value in bias.items()}


async def admit(ctx: ServingContext, prompts: list[str | list[int]], params: SamplingParams,
                body: SamplingFields, request_id: str, kv_transfer: KVTransferArgs = KVTransferArgs(),
                names: Mapping[str, str] | None = None) -> list[RequestStream]:
    """One engine request per prompt (``{request_id}-{i}``), all or none, in one call
    (``AsyncEngine.add_requests``: every prompt is checked before any is admitted). A refusal
    raises the matching APIError: 400 for a prompt the engine refuses, then 429, 503. ``names``
    maps a SamplingParams field to the request field the client sent (chat's ``top_logprobs``
    for ``logprobs``; ``response_format`` or ``tools`` for ``structured_outputs``).
    ``kv_transfer`` applies to a single prompt."""
    batch = RequestBatch(prompts, params, [f"{request_id}-{i}" for i in range(len(prompts))],
                         body.priority, body.cache_salt, kv_transfer.remote_decode,
                         kv_transfer.remote_prefill)
    try:
        streams = await ctx.engine.add_requests(batch)
    except InvalidRequest as exc:
        name = (names or {}).get(exc.param, exc.param)
        raise APIError(400, f"{name} {exc.detail}", param=name,
                       code=getattr(exc, "code", "invalid_request")) from exc
    except Exception as exc:
        raise api_error_from(exc) from exc
    follow_in_background(ctx, kv_transfer, streams[0])
    if ctx.log_requests:
        logger.info("%s: admitted %d prompt(s) of %s tokens, priority %d, %s", request_id, len(streams),
                    [s.num_prompt_tokens for s in streams], body.priority, params)
    return streams


def close_all(streams: list[RequestStream]) -> None:
    """Abort the unfinished streams."""
    for stream in streams:
        stream.close()


async def merged(ctx: ServingContext,
                 streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) whenever a stream's output has grown, each stream's
    finished output exactly once and last; engine failures raise as APIError. The output is the
    stream's own object, which goes on growing: render it before the next ``await``. Closing the
    iterator early aborts the unfinished requests."""
    inbox: asyncio.Queue = asyncio.Queue()
    pending: set[int] = set()  # indices in the inbox: a reader that falls behind holds one each
    # Streams whose pump has taken the finished output (timed it, counted it, logged it). The
    # shared output object can turn finished before its pump has read that last item; the loop
    # below ends a stream only once its pump has, or its metrics and log line would be lost.
    recorded: set[int] = set()

    async def pump(index: int, stream: RequestStream) -> None:
        timer = RequestTimer(ctx.metrics, stream.arrival_time)
        try:
            async for out in stream:
                timer.on_output(out)
                if out.finished:
                    if ctx.log_requests:
                        _log_finished(stream, out)
                    recorded.add(index)
                if index not in pending:
                    pending.add(index)
                    inbox.put_nowait(index)
        except Exception as exc:  # noqa: BLE001 — handed to the consumer
            inbox.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    done: set[int] = set()
    try:
        while len(done) < len(streams):
            index = await inbox.get()
            if isinstance(index, Exception):
                raise api_error_from(index) from index
            pending.discard(index)
            if index in done:
                continue
            out = streams[index].output
            if out.finished:
                if index not in recorded:  # its pump has yet to take the last item: it will say so
                    continue
                done.add(index)
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        close_all(streams)


def _log_finished(stream: RequestStream, out: RequestOutput) -> None:
    logger.info("%s: finished in %.3f s, %d prompt tokens, output tokens %s, finish reasons %s",
                stream.request_id, time.monotonic() - stream.arrival_time, stream.num_prompt_tokens,
                [len(o.token_ids) for o in out.outputs], [o.finish_reason for o in out.outputs])


async def until_disconnect(request: Request, work: Callable[[], object]) -> object:
    """Run the coroutine ``work()`` unless the client disconnects first; then cancel it (which
    aborts its engine requests) and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Server-sent events: ``data: <json>`` per chunk, ``data: [DONE]`` at the end. However the
    response ends (finished, client gone, cancelled), the unfinished engine requests are aborted,
    even when the body iterator never started; a client that left counts as an error.

    A client that reads nothing stalls the writes once the socket buffers are full (the kernel's
    and uvicorn's hold some hundreds of KiB); a write blocked for ``stream_stall_timeout_s``
    ends the response and aborts its requests (reason "client_stalled"). Meanwhile the engine
    goes on filling the stream's one cumulative output, so a stalled client costs its request's
    size, never a queue of copies."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[str], ctx: ServingContext, streams: list[RequestStream]) -> None:
        super().__init__(chunks, headers={"Cache-Control": "no-cache"})
        self._ctx = ctx
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        timeout_s = self._ctx.stream_stall_timeout_s

        async def send_or_give_up(message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout_s)
            except TimeoutError:
                raise _ClientStalled() from None

        reason = "client_disconnected"
        try:
            await super().__call__(scope, receive, send_or_give_up)
        except _ClientStalled:
            reason = "client_stalled"
            logger.warning("%s: the client read nothing for %g s; aborted",
                           ", ".join(s.request_id for s in self._streams), timeout_s)
            for stream in self._streams:
                stream.close()
        finally:
            await self.body_iterator.aclose()  # its merged() cancels the readers of the streams
            close_all(self._streams)
            if any(s.state is StreamState.ABORTED for s in self._streams):
                self._ctx.metrics.record_error(reason)


class _ClientStalled(Exception):
    """A write to the client blocked for longer than ``server.stream_stall_timeout_s``."""


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(error: APIError) -> str:
    return sse(json.dumps(error.body().model_dump()))


SSE_DONE = sse("[DONE]")
