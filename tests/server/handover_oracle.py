"""The MACs of a hand-over, recomputed from their written definition (``tandem.handover_auth``'s
docstring) with Python's ``hmac``: the oracle the decode and prefill instances are checked
against, and how a test signs a hand-over it crafts (as a holder of the secret would)."""
from __future__ import annotations

import hashlib
import hmac
import json
import struct

SIGNED_FIELDS = ("engine_id", "transfer_id", "block_ids", "num_tokens", "prompt_digest",
                 "compat_hash", "handshake_url", "expires_at")


def prompt_digest(secret: str, token_ids: list[int], cache_salt: str | None = None) -> str:
    message = (b"tandem-prompt-v1\n" + json.dumps(cache_salt).encode() + b"\n"
               + struct.pack(f"<{len(token_ids)}q", *token_ids))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signature(secret: str, params: dict) -> str:
    canonical = json.dumps({k: params[k] for k in SIGNED_FIELDS}, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret.encode(), b"tandem-handover-v1\n" + canonical.encode(), hashlib.sha256).hexdigest()


def signed(secret: str, params: dict) -> dict:
    """``params`` with the signature a holder of ``secret`` gives them."""
    return {**params, "signature": signature(secret, params)}
