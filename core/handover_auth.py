"""Signed hand-overs: a decode instance believes a prefill instance's ``kv_transfer_params`` only
when they carry that instance's HMAC-SHA256 under the cluster secret
(``disaggregation.kv_transfer_secret``), checked in constant time before anything is fetched or
read. Both MACs are written so that anyone holding the secret can recompute them::

    prompt_digest = HMAC-SHA256(secret, b"tandem-prompt-v1\\n" + json(cache_salt) + b"\\n"
                                        + token ids as little-endian int64).hexdigest()
    signature     = HMAC-SHA256(secret, b"tandem-handover-v1\\n" + json({field: value for field
                                        in SIGNED_FIELDS}, sort_keys, separators (",", ":"))).hexdigest()

A streamed hand-over's ``stream: true`` is signed with the other fields (only when present, so a
whole hand-over signs as before), and each of its announcements (``tandem.kv_stream``) carries
``HMAC-SHA256(secret, b"tandem-kv-announcement-v1\n" + json(announcement))`` written the same way.
``json`` is Python's ``json.dumps`` (so ``json(None)`` is ``null``); ``cache_salt`` is the
request's as the engine keys its prefix cache (``tandem.sched.request.request_cache_salt``: the
client's salt and the engine's KV variant, or None when neither is set). The digest is keyed, so a
hand-over reveals nothing about its prompt to whoever sees it, and it covers the request's cache
salt, so KV prefilled under one salt is never loaded under another. ``handshake_url`` and
``expires_at`` (Unix seconds) are signed: a hand-over can be neither redirected to another URL
nor kept past its pin's expiry.

Without a secret (an operator's explicit insecure opt-out) the digest is the same HMAC with an
empty key — a checksum, not a proof — and hand-overs are unsigned: a decode instance without a
secret accepts only unsigned ones, one with a secret only signed ones, so a hand-over is unsigned
exactly when both sides opted out.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

SIGNED_FIELDS = ("engine_id", "transfer_id", "block_ids", "num_tokens", "prompt_digest",
                 "compat_hash", "handshake_url", "expires_at")
OPTIONAL_SIGNED_FIELDS = ("stream",)
"""Signed when present: a streamed hand-over's ``stream: true`` (its blocks are announced)."""
_PROMPT_DOMAIN = b"tandem-prompt-v1\n"
_HANDOVER_DOMAIN = b"tandem-handover-v1\n"
_ANNOUNCEMENT_DOMAIN = b"tandem-kv-announcement-v1\n"


class HandOverRefused(ValueError):
    """A hand-over whose signature is missing, unexpected or wrong (HTTP 400)."""


class HandOverExpired(ValueError):
    """A correctly signed hand-over past its ``expires_at``: its pin is gone or about to go."""


def prompt_digest(token_ids: Sequence[int], cache_salt: str | None, secret: bytes | None) -> str:
    """The keyed digest of a prompt and its cache salt (see the module docstring)."""
    tokens = array("q", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    message = _PROMPT_DOMAIN + json.dumps(cache_salt).encode() + b"\n" + tokens.tobytes()
    return hmac.new(secret or b"", message, hashlib.sha256).hexdigest()


def signature(params: Mapping[str, Any], secret: bytes) -> str:
    """The HMAC of ``params``' ``SIGNED_FIELDS`` (each must be present)."""
    signed = {name: params[name] for name in SIGNED_FIELDS}
    signed |= {name: params[name] for name in OPTIONAL_SIGNED_FIELDS if params.get(name) is not None}
    return _mac(secret, _HANDOVER_DOMAIN, signed)


def announcement_signature(announcement: Mapping[str, Any], secret: bytes) -> str:
    """The HMAC of a streamed hand-over's announcement (``tandem.kv_stream.KVAnnouncement.to_json``),
    under the domain ``tandem-kv-announcement-v1``, written like ``signature``."""
    return _mac(secret, _ANNOUNCEMENT_DOMAIN, dict(announcement))


def check_announcement(announcement: Mapping[str, Any], secret: bytes | None) -> None:
    """Raise ``HandOverRefused`` unless ``announcement`` carries the ``signature`` this instance
    expects (none without a secret), compared in constant time."""
    fields = {k: v for k, v in announcement.items() if k != "signature"}
    given = announcement.get("signature")
    if secret is None:
        if given is not None:
            raise HandOverRefused("the announcement is signed but this instance has no kv_transfer_secret")
        return
    if not isinstance(given, str) or not hmac.compare_digest(
            given.encode(), announcement_signature(fields, secret).encode()):
        raise HandOverRefused("the announcement's signature is missing or does not match")


def _mac(secret: bytes, domain: bytes, fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, domain + canonical, hashlib.sha256).hexdigest()


def sign(params: dict[str, Any], secret: bytes | None) -> dict[str, Any]:
    """``params`` with their ``signature`` (unchanged without a secret)."""
    return params if secret is None else {**params, "signature": signature(params, secret)}


def verify(params: Mapping[str, Any], secret: bytes | None, now_s: float) -> None:
    """Raise ``HandOverRefused`` unless ``params`` are signed as this instance expects (see the
    module docstring), then ``HandOverExpired`` when ``now_s`` (Unix seconds) is past their
    ``expires_at``. The signature is compared in constant time."""
    given = params.get("signature")
    if secret is None and given is not None:
        raise HandOverRefused("the hand-over is signed but this instance has no "
                              "disaggregation.kv_transfer_secret to check it with")
    if secret is not None:
        if given is None:
            raise HandOverRefused("the hand-over is not signed: its prefill instance has no "
                                  "disaggregation.kv_transfer_secret, or it was not made by one")
        if not hmac.compare_digest(given.encode(), signature(params, secret).encode()):
            raise HandOverRefused("the hand-over's signature does not match its parameters: it was "
                                  "altered, or signed under another kv_transfer_secret")
    if now_s >= params["expires_at"]:
        raise HandOverExpired(f"the hand-over expired at {params['expires_at']} (Unix time); "
                              "its KV blocks are released on the prefill instance")
