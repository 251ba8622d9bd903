"""The server half of disaggregated prefill/decode: a request's ``kv_transfer_params``, the
prefill instance's handshake, and the hand-over in a prefill answer.

::

    router → prefill instance   kv_transfer_params = {"do_remote_decode": true}, max_tokens 1,
                                not streamed, n 1  → the answer carries kv_transfer_params =
                                {engine_id, handshake_url, transfer_id, block_ids, num_tokens,
                                 compat_hash}
    router → decode instance    kv_transfer_params = that + {"do_remote_prefill": true}
                                → GET handshake_url (once per prefill engine, on the event loop;
                                  cached by engine_id) → the engine loads the blocks

An instance ignores the half of the hand-over that is not its role's (a colocated instance
ignores both): it serves the request as an ordinary one, so a router that mistakes its role still
gets correct answers. A compat-hash mismatch is a 400 naming both hashes. A prefill instance whose handshake cannot be
fetched is a load failure: under ``kv_load_failure_policy = "recompute"`` the decode instance
computes the prompt itself, under "fail" the answer is a 502.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from pydantic import BaseModel

from tandem.kv_transfer import RemotePrefill
from tandem.outputs import RequestOutput
from tandem.server.errors import APIError, bad_request
from tandem.server.protocol import SamplingFields

logger = logging.getLogger("tandem.server")

HANDSHAKE_PATH = "/kv/handshake"
HANDSHAKE_TIMEOUT_S = 10.0
_PARAM = "kv_transfer_params"


@dataclass(slots=True, frozen=True)
class KVTransferArgs:
    """What the engine gets with one request (see ``LLMEngine.add_request``)."""

    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None

    @property
    def active(self) -> bool:
        return self.remote_decode or self.remote_prefill is not None


class HandshakeCache:
    """Prefill instances' handshakes by engine id (a restarted instance has a new engine id)."""

    def __init__(self, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._handshakes: dict[str, dict[str, Any]] = {}

    async def get(self, engine_id: str, url: str) -> dict[str, Any]:
        """Raises ``httpx.HTTPError`` or ``ValueError`` when the handshake cannot be had."""
        cached = self._handshakes.get(engine_id)
        if cached is not None:
            return cached
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            response = await client.get(url)
            response.raise_for_status()
            handshake = response.json()
        if not isinstance(handshake, dict) or handshake.get("engine_id") != engine_id:
            raise ValueError(f"{url} answered the handshake of another engine "
                             f"({handshake.get('engine_id') if isinstance(handshake, dict) else None!r})")
        self._handshakes[engine_id] = handshake
        return handshake


async def kv_transfer_args(engine, handshakes: HandshakeCache, body: SamplingFields,
                           num_prompts: int) -> KVTransferArgs:
    """Check ``body.kv_transfer_params`` against this instance's role (``engine`` is the
    ``LLMEngine``) and, on a decode instance, fetch the prefill instance's handshake."""
    params = body.kv_transfer_params
    if params is None:
        return KVTransferArgs()
    role = engine.config.disaggregation.role
    remote_decode, remote_prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    if remote_decode is not True and remote_prefill is not True:
        raise bad_request("kv_transfer_params must set do_remote_decode or do_remote_prefill", _PARAM)
    if remote_decode is True:
        if role != "prefill":
            logger.info("role %s: ignoring do_remote_decode, serving the request in full", role)
            return KVTransferArgs()
        _require(not body.stream and body.n == 1 and num_prompts == 1,
                 "do_remote_decode needs one prompt, n = 1 and stream = false")
        return KVTransferArgs(remote_decode=True)
    if role != "decode":
        logger.info("role %s: ignoring do_remote_prefill, computing the prompt here", role)
        return KVTransferArgs()
    _require(num_prompts == 1, "do_remote_prefill needs one prompt")
    local = engine.kv_transfer.compat_hash
    if params.get("compat_hash") != local:
        raise bad_request(f"KV compat hash mismatch: the prefill instance has {params.get('compat_hash')!r}, "
                          f"this decode instance {local!r}; both must serve the same model with the same "
                          "dtype, layer count, KV heads, head size and block size", _PARAM)
    url = params.get("handshake_url")
    _require(isinstance(url, str) and url.startswith(("http://", "https://")),
             "kv_transfer_params.handshake_url must be an http(s) URL")
    try:
        handshake = await handshakes.get(str(params.get("engine_id")), url)
    except (httpx.HTTPError, ValueError) as exc:
        message = f"cannot fetch the KV handshake of the prefill instance at {url}: {exc}"
        if engine.config.disaggregation.kv_load_failure_policy == "fail":
            raise APIError(502, message, code="kv_transfer_failed") from exc
        logger.warning("%s; computing the prompt here", message)
        return KVTransferArgs()
    try:
        return KVTransferArgs(remote_prefill=RemotePrefill.from_params(params, handshake))
    except ValueError as exc:
        raise bad_request(str(exc), _PARAM) from exc


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise bad_request(message, _PARAM)


def hand_over(out: RequestOutput, request: Request) -> dict[str, Any] | None:
    """A prefill answer's ``kv_transfer_params``: the engine's, plus where to fetch the handshake
    (this server, at the address the caller reached it by). None when nothing was pinned."""
    if out.kv_transfer_params is None:
        return None
    params = {**out.kv_transfer_params,
              "handshake_url": str(request.base_url).rstrip("/") + HANDSHAKE_PATH}
    params.setdefault("prompt_digest", _prompt_digest(out.prompt_token_ids))
    return params


def _prompt_digest(token_ids: list[int]) -> str:
    """TEMPORARY, until the engine's kv_transfer_params carry ``prompt_digest`` (issue 12, the
    lead's change to tandem.kv_transfer): revert this commit at that merge."""
    import hashlib
    from array import array

    return hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16).hexdigest()


def dump(response: BaseModel) -> dict[str, Any]:
    """A response body, without ``kv_transfer_params`` unless it is set."""
    data = response.model_dump()
    if data.get(_PARAM) is None:
        data.pop(_PARAM, None)
    return data
