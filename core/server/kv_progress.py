"""The server half of streamed hand-overs (``disaggregation.stream_kv``, ``tandem.kv_stream``).

Prefill instance: a ``do_remote_decode`` request is answered as soon as the engine admitted it
(``early_hand_over``: ``kv_transfer_params`` with ``block_ids: []`` and ``stream: true``,
signed), while the request goes on in the background; ``GET /kv/progress?transfer_id=T&known=N``
answers the transfer's latest announcement once it lists more than ``N`` blocks or has ended
(waiting at most ``PROGRESS_WAIT_S``), signed under the cluster secret.

Decode instance: ``follow_announcements`` asks the prefill instance's ``/kv/progress`` (beside
its signed ``handshake_url``) again and again while the request lives, checks each answer's
signature and hands it to the engine. A prefill instance that cannot be reached, answers an
error or an unsigned announcement, or announces nothing new for ``kv_transfer_timeout_s`` ends
the load as failed ("peer"): the request recomputes or fails per ``kv_load_failure_policy``.
"""
from __future__ import annotations

import asyncio
import logging
import time

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from tandem.async_engine import RequestStream, StreamState
from tandem.handover_auth import HandOverRefused, announcement_signature, check_announcement
from tandem.json_bounds import loads_bounded
from tandem.kv_stream import KVAnnouncement
from tandem.server.disagg import KV_SECRET_HEADER, KVTransferArgs, signed_hand_over
from tandem.server.errors import APIError
from tandem.server.metrics import RequestTimer

logger = logging.getLogger("tandem.server")

PROGRESS_WAIT_S = 1.0
"""The longest a ``/kv/progress`` answer waits for news."""
_BOARD_POLL_S = 0.002
_MAX_ANSWER_BYTES = 1 << 20
_RETRY_S = 0.05


def early_hand_over(ctx, stream: RequestStream, request: Request) -> JSONResponse | None:
    """A prefill instance's answer to a streamed ``do_remote_decode`` request, right after
    admission (None: the engine does not stream this one). The request runs on, its stream
    read in the background until it ends."""
    params = ctx.engine.kv_board.take_params(stream.request_id)
    if params is None:
        return None
    task = asyncio.ensure_future(_drain(stream, RequestTimer(ctx.metrics, stream.arrival_time)))
    ctx.kv_tasks.add(task)
    task.add_done_callback(ctx.kv_tasks.discard)
    return JSONResponse({"id": stream.request_id, "object": "kv_hand_over",
                         "kv_transfer_params": signed_hand_over(params, request)})


async def _drain(stream: RequestStream, timer: RequestTimer) -> None:
    try:
        async for out in stream:
            timer.on_output(out)
    except Exception as exc:  # noqa: BLE001 - its announcement says "failed"; nobody else waits
        logger.info("streamed prefill %s ended: %s", stream.request_id, exc)
    finally:
        stream.close()


async def progress_answer(ctx, transfer_id: str, known: int) -> JSONResponse:
    """The latest announcement of ``transfer_id`` once it lists more than ``known`` blocks or
    has ended, else after ``PROGRESS_WAIT_S`` as it is; 404 for a transfer the board lacks."""
    board = ctx.engine.kv_board
    deadline = time.monotonic() + PROGRESS_WAIT_S
    while True:
        announcement = board.get(transfer_id)
        if announcement is None:
            raise APIError(404, f"no streamed hand-over {transfer_id!r} here", code="not_found")
        if announcement.ended or len(announcement.block_ids) > known or time.monotonic() >= deadline:
            break
        await asyncio.sleep(_BOARD_POLL_S)
    body = announcement.to_json()
    secret = ctx.engine.kv_secret
    if secret is not None:
        body["signature"] = announcement_signature(body, secret)
    return JSONResponse(body)


def follow_in_background(ctx, kv_transfer: KVTransferArgs, stream: RequestStream) -> None:
    """On a decode instance, follow a streamed hand-over's announcements while ``stream`` lives
    (nothing for a hand-over that is not streamed)."""
    if kv_transfer.progress_url is None:
        return
    task = asyncio.ensure_future(follow_announcements(
        ctx.engine, kv_transfer.remote_prefill.transfer_id, kv_transfer.progress_url, ctx.kv_secret, stream))
    ctx.kv_tasks.add(task)
    task.add_done_callback(ctx.kv_tasks.discard)


async def follow_announcements(engine, transfer_id: str, url: str, secret: str | None,
                               stream: RequestStream) -> None:
    """Feed the engine the announcements of ``transfer_id`` from ``url`` while ``stream`` lives
    (see the module docstring); never raises."""
    timeout_s = engine.disaggregation.kv_transfer_timeout_s
    headers = {KV_SECRET_HEADER: secret} if secret is not None else {}
    key = secret.encode() if secret is not None else None
    known, last_news = 0, time.monotonic()
    client_timeout = httpx.Timeout(PROGRESS_WAIT_S + 5.0, connect=5.0)
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=client_timeout) as client:
        while stream.state in (StreamState.PENDING, StreamState.STREAMING):
            try:
                announcement = await _ask(client, url, transfer_id, known, headers, key)
            except httpx.TimeoutException as exc:
                reason = f"{type(exc).__name__}"
            except (httpx.HTTPError, ValueError, HandOverRefused) as exc:
                _fail(engine, transfer_id, f"{type(exc).__name__}: {exc}")
                return
            else:
                reason = "no news"
                if announcement.ended or len(announcement.block_ids) > known:
                    engine.announce_kv(announcement)
                    known, last_news = len(announcement.block_ids), time.monotonic()
                    if announcement.ended:
                        return
            if time.monotonic() - last_news > timeout_s:
                _fail(engine, transfer_id, f"{reason} within kv_transfer_timeout_s ({timeout_s:g} s)")
                return
            if reason != "no news":
                await asyncio.sleep(_RETRY_S)


async def _ask(client: httpx.AsyncClient, url: str, transfer_id: str, known: int,
               headers: dict[str, str], key: bytes | None) -> KVAnnouncement:
    response = await client.get(url, params={"transfer_id": transfer_id, "known": known}, headers=headers)
    if response.status_code != 200:
        raise ValueError(f"{url} answered {response.status_code}")
    if len(response.content) > _MAX_ANSWER_BYTES:
        raise ValueError(f"{url} answered more than {_MAX_ANSWER_BYTES} bytes")
    data = loads_bounded(response.content, 4)
    if not isinstance(data, dict):
        raise ValueError("an announcement is a JSON object")
    check_announcement(data, key)
    announcement = KVAnnouncement.from_json(data)
    if announcement.transfer_id != transfer_id:
        raise ValueError(f"{url} announced another transfer")
    return announcement


def _fail(engine, transfer_id: str, why: str) -> None:
    logger.warning("streamed hand-over %s: no more announcements (%s)", transfer_id, why)
    engine.announce_kv(KVAnnouncement(transfer_id, (), "failed"))
