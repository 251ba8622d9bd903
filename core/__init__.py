"""tandem: an LLM inference server with a paged KV cache, continuous batching and a plugin core.

``import tandem`` stays light: the heavy names are loaded on first use (PEP 562), so that
``import tandem.sched`` never pulls in torch.
"""
from __future__ import annotations

import importlib
from typing import Any

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("tandem")
"""Decorator for plugin hook implementations: ``@tandem.hookimpl``."""

_LAZY = {
    "LLM": "tandem.llm",
    "SamplingParams": "tandem.sampling_params",
    "StructuredOutputsParams": "tandem.sampling_params",
    "RequestOutput": "tandem.outputs",
    "CompletionOutput": "tandem.outputs",
    "TandemConfig": "tandem.config",
}

__all__ = ["__version__", "hookimpl", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
