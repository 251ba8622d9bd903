"""Which model ids the router relays to ``GET /v1/models/{id}``.

The id travels in the instance's URL path, so it must not be able to name another route: every
``/``-separated segment is made of letters, digits and ``_ . - + : @ = ~`` and is not all dots
(``.`` and ``..`` would climb out of /v1/models once a client library or the instance normalises
the path). That holds Hugging Face ids (``org/name``, ``Llama-3.1-8B``) and tandem's default id,
the model folder's absolute path. Starlette decodes ``%2e`` and ``%2F`` before the id is read,
so the encoded forms are checked as the dots and slashes they are; a ``%`` left after that (a
double encoding) is refused too.
"""
from __future__ import annotations

import re

MAX_MODEL_ID_CHARS = 512
_SEGMENT = re.compile(r"[A-Za-z0-9_.\-+:@=~]+")


def is_valid_model_id(model_id: str) -> bool:
    """Whether ``model_id`` (decoded) may be relayed in a URL path (module docstring)."""
    if not model_id or len(model_id) > MAX_MODEL_ID_CHARS:
        return False
    segments = model_id.removeprefix("/").split("/")
    return all(_SEGMENT.fullmatch(s) and s.strip(".") for s in segments)
