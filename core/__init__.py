"""tandem: an LLM inference server with a paged KV cache, continuous batching and a plugin core.

``import tandem`` stays light: the heavy names are loaded on first use (PEP 562), so that
``import tandem.sched`` never pulls in torch.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import pluggy

# Idle OpenMP threads must sleep, not spin: between its kernels' calls a decode step runs torch
# operators on OpenMP's threads, and threads left spinning after them take the cores from
# tandem's own kernel threads and from the server's event loop (docs/benchmarks.md, "OpenMP wait
# policy", has the figures). libgomp reads this once,
# when torch is imported, so it is set here, before anything of tandem imports torch; an explicit
# OMP_WAIT_POLICY in the environment wins. Where torch came first, the CPU worker warns
# (``OMP_POLICY_MISSED``).
OMP_POLICY_MISSED = "OMP_WAIT_POLICY" not in os.environ and "torch" in sys.modules
OMP_POLICY_SET = "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules
"""True where tandem set OMP_WAIT_POLICY itself: other programs it starts (a benchmark's peers)
get the environment without it (``tandem.bench.peers.peer_env``)."""
if OMP_POLICY_SET:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

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
