"""The server half of disaggregated prefill/decode: a request's ``kv_transfer_params`` (parsed
into ``KVTransferParams`` at the API boundary), the cluster secret, the prefill instance's
handshake, and the hand-over in a prefill answer. The protocol, drawn: docs/disaggregation.md.

Contract: with a cluster secret (``disaggregation.kv_transfer_secret``), ``kv_transfer_params``,
``/kv/handshake`` and ``/kv/release`` without the header ``X-Tandem-KV-Secret`` are a 401 before
anything is done (nothing pinned, nothing fetched). A decode instance refuses (400) a hand-over
that is unsigned, altered or signed under another secret before it fetches or reads anything —
why: whoever gets params relayed with the header must not forge or redirect a hand-over. Its
handshake fetches are http(s) only and bounded in time, size and depth. An instance ignores the
half of the hand-over that is not its role's, so a router that mistakes its role still gets
correct answers. A compat-hash mismatch is a 400 naming both hashes; an unreachable handshake is
a load failure (recompute, or 502 under ``kv_load_failure_policy = "fail"``).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from pydantic import BaseModel

from tandem.config import Role
from tandem.handover_auth import HandOverExpired, HandOverRefused, sign, verify
from tandem.json_bounds import loads_bounded
from tandem.kv_transfer import RemotePrefill
from tandem.outputs import RequestOutput
from tandem.server.errors import APIError, bad_request
from tandem.server.protocol import SamplingFields

logger = logging.getLogger("tandem.server")

HANDSHAKE_PATH = "/kv/handshake"
RELEASE_PATH = "/kv/release"
KV_EVENTS_PATH = "/kv/events"
PROGRESS_PATH = "/kv/progress"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
KV_SECRET_HEADER = "X-Tandem-KV-Secret"
HANDSHAKE_TIMEOUT_S = 10.0
"""The whole fetch of one handshake, connection to last byte."""
HANDSHAKE_MAX_BYTES = 1 << 20
"""A handshake is a few KiB of NIXL metadata; a larger answer is refused while it streams in."""
HANDSHAKE_CACHE_SIZE = 256
"""Prefill engines whose handshake a decode instance keeps (least recently used goes first)."""
HANDSHAKE_MAX_DEPTH = 8
"""A handshake nests two or three levels (a TP instance lists its ranks); deeper is refused."""
_PARAM = "kv_transfer_params"


@dataclass(slots=True, frozen=True)
class KVTransferArgs:
    """What the engine gets with one request (see ``LLMEngine.add_request``)."""

    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None
    progress_url: str | None = None
    """A streamed hand-over's: where the prefill instance announces its blocks."""

    @property
    def active(self) -> bool:
        return self.remote_decode or self.remote_prefill is not None


def check_kv_secret(secret: str | None, request: Request) -> None:
    """401 unless ``request`` carries the cluster ``secret`` (nothing to check without one);
    compared in constant time."""
    if secret is None:
        return
    given = request.headers.get(KV_SECRET_HEADER, "").encode("latin-1")
    if not hmac.compare_digest(given, secret.encode()):
        raise APIError(401, f"kv_transfer_params, {HANDSHAKE_PATH} and {RELEASE_PATH} need the cluster's "
                            f"secret in the header {KV_SECRET_HEADER} (disaggregation.kv_transfer_secret)",
                       code="invalid_kv_secret")


class HandshakeError(Exception):
    """A handshake that could not be had: unreachable, an error status, too large, not JSON or
    nested too deep, another engine's."""


class HandshakeCache:
    """Prefill instances' handshakes by engine id, the ``max_entries`` most recently used. A
    restarted prefill instance has a new engine id, so it is fetched again (its old entry ages
    out); a fetch that fails leaves no entry. Fetches send the cluster ``secret``, follow no
    redirect, read no proxy settings, and give up after ``timeout_s`` or ``max_bytes``. The
    decode engine names the engines whose peer it found dead (``forget``): a prefill instance
    whose connector restarted with a new agent keeps its engine id and URL, so only a fresh
    fetch gives its new metadata."""

    def __init__(self, timeout_s: float = HANDSHAKE_TIMEOUT_S, max_bytes: int = HANDSHAKE_MAX_BYTES,
                 max_entries: int = HANDSHAKE_CACHE_SIZE, secret: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._secret = secret
        self._handshakes: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._handshakes)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._handshakes

    def forget(self, engine_id: str) -> None:
        """Drop ``engine_id``'s handshake: the next ``get`` fetches it again."""
        self._handshakes.pop(engine_id, None)

    async def get(self, engine_id: str, url: str) -> dict[str, Any]:
        """The handshake of ``engine_id``, fetched from ``url`` unless cached. Raises
        ``HandshakeError``."""
        cached = self._handshakes.get(engine_id)
        if cached is not None:
            self._handshakes.move_to_end(engine_id)
            return cached
        try:
            handshake = await asyncio.wait_for(self._fetch(url), self.timeout_s)
        except TimeoutError:
            raise HandshakeError(f"no handshake from {url} within {self.timeout_s:g} s") from None
        if handshake.get("engine_id") != engine_id:
            raise HandshakeError(f"{url} answered the handshake of another engine "
                                 f"({handshake.get('engine_id')!r})")
        self._handshakes[engine_id] = handshake
        while len(self._handshakes) > self.max_entries:
            self._handshakes.popitem(last=False)
        return handshake

    async def _fetch(self, url: str) -> dict[str, Any]:
        if not url.startswith(("http://", "https://")):
            raise HandshakeError(f"{url!r} is not an http(s) URL")
        headers = {KV_SECRET_HEADER: self._secret} if self._secret is not None else {}
        try:
            async with httpx.AsyncClient(trust_env=False, follow_redirects=False) as client:
                async with client.stream("GET", url, headers=headers) as response:
                    if response.status_code != 200:
                        raise HandshakeError(f"{url} answered {response.status_code}")
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body += chunk
                        if len(body) > self.max_bytes:
                            raise HandshakeError(f"{url} answered more than {self.max_bytes} bytes")
        except httpx.HTTPError as exc:
            raise HandshakeError(f"{url}: {type(exc).__name__}: {exc}") from exc
        try:
            handshake = loads_bounded(bytes(body), HANDSHAKE_MAX_DEPTH)
        except ValueError as exc:
            raise HandshakeError(f"{url} answered something that is not a handshake: {exc}") from None
        if not isinstance(handshake, dict):
            raise HandshakeError(f"{url} answered JSON that is not an object")
        return handshake


async def kv_transfer_args(engine, handshakes: HandshakeCache, body: SamplingFields,
                           num_prompts: int) -> KVTransferArgs:
    """Check ``body.kv_transfer_params`` against this instance's role (``engine`` is the
    ``AsyncEngine``) and, on a decode instance, fetch the prefill instance's handshake. The
    request's secret has been checked (``check_kv_secret``)."""
    params = body.kv_transfer_params
    if params is None:
        return KVTransferArgs()
    role = engine.disaggregation.role
    if params.do_remote_decode:
        if role is not Role.PREFILL:
            logger.info("role %s: ignoring do_remote_decode, serving the request in full", role)
            return KVTransferArgs()
        _require(not body.stream and body.n == 1 and num_prompts == 1,
                 "do_remote_decode needs one prompt, n = 1 and stream = false")
        return KVTransferArgs(remote_decode=True)
    if role is not Role.DECODE:
        logger.info("role %s: ignoring do_remote_prefill, computing the prompt here", role)
        return KVTransferArgs()
    _require(num_prompts == 1, "do_remote_prefill needs one prompt")
    missing = params.missing_for_remote_prefill()
    _require(not missing, f"do_remote_prefill needs {', '.join(f'{_PARAM}.{m}' for m in missing)}")
    remote = params.remote_prefill_params()
    try:
        verify(remote, engine.kv_secret, time.time())
    except HandOverRefused as exc:
        raise APIError(400, str(exc), param=_PARAM, code="invalid_kv_signature") from exc
    except HandOverExpired as exc:
        return _load_failure(engine, str(exc), exc)
    local = engine.kv_compat_hash
    if params.compat_hash != local:
        raise bad_request(f"KV compat hash mismatch: the prefill instance has {params.compat_hash!r}, "
                          f"this decode instance {local!r}; both must serve the same checkpoint "
                          "(weights) and tokenizer with the same dtype, layer count, KV heads, head "
                          "size and block size (their tensor and pipeline parallel sizes may differ)",
                          _PARAM)
    for engine_id in engine.take_stale_kv_handshakes():
        handshakes.forget(engine_id)
    try:
        handshake = await handshakes.get(params.engine_id, params.handshake_url)
    except HandshakeError as exc:
        return _load_failure(engine, f"cannot fetch the KV handshake of the prefill instance: {exc}", exc)
    try:
        remote_prefill = RemotePrefill.from_params(remote, handshake)
    except ValueError as exc:
        raise bad_request(str(exc), _PARAM) from exc
    progress_url = None
    if remote_prefill.stream:
        _require(params.handshake_url.endswith(HANDSHAKE_PATH),
                 f"a streamed hand-over's handshake_url must end with {HANDSHAKE_PATH}")
        progress_url = params.handshake_url.removesuffix(HANDSHAKE_PATH) + PROGRESS_PATH
    return KVTransferArgs(remote_prefill=remote_prefill, progress_url=progress_url)


def _load_failure(engine, message: str, cause: Exception) -> KVTransferArgs:
    """A hand-over that will not be read: a 502 under ``kv_load_failure_policy = "fail"``, else
    the prompt is computed here."""
    if engine.disaggregation.kv_load_failure_policy == "fail":
        raise APIError(502, message, code="kv_transfer_failed") from cause
    logger.warning("%s; computing the prompt here", message)
    return KVTransferArgs()


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise bad_request(message, _PARAM)


def hand_over(out: RequestOutput, request: Request) -> dict[str, Any] | None:
    """A prefill answer's ``kv_transfer_params``: the engine's, plus where to fetch the handshake
    (this server, at the address the caller reached it by), signed under the cluster secret.
    None when nothing was pinned."""
    if out.kv_transfer_params is None:
        return None
    return signed_hand_over(out.kv_transfer_params, request)


def signed_hand_over(params: dict[str, Any], request: Request) -> dict[str, Any]:
    """The engine's hand-over ``params`` plus where to fetch the handshake (this server, at the
    address the caller reached it by), signed under the cluster secret."""
    secret = request.app.state.tandem.kv_secret
    return sign({**params, "handshake_url": str(request.base_url).rstrip("/") + HANDSHAKE_PATH},
                secret.encode() if secret is not None else None)


def dump(response: BaseModel) -> dict[str, Any]:
    """A response body, without ``kv_transfer_params`` unless it is set."""
    data = response.model_dump()
    if data.get(_PARAM) is None:
        data.pop(_PARAM, None)
    return data
