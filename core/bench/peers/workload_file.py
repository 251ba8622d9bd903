"""The workload file a peer's driver reads (``vllm_offline_driver``, ``llamacpp_driver``). Standard
library only: the drivers run under the peer's own python, where tandem is not installed, and
import this file as a sibling (their folder is first on ``sys.path``)."""
from __future__ import annotations

import json
from collections.abc import Sequence


def load_workload(path: str, keys: Sequence[str]) -> dict:
    """The workload file as a dict; a missing one of ``keys`` is a ``ValueError`` naming it, and
    so are prompts and max_tokens of different lengths."""
    with open(path) as f:
        workload = json.load(f)
    missing = [k for k in keys if k not in workload]
    if missing:
        raise ValueError(f"{path}: workload file lacks {', '.join(missing)}")
    if len(workload["prompts"]) != len(workload["max_tokens"]):
        raise ValueError(f"{path}: {len(workload['prompts'])} prompts but "
                         f"{len(workload['max_tokens'])} max_tokens")
    return workload
