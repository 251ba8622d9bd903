"""Registers the built-in CPU attention backends, "torch" (the reference) and "cpu" (its decode
attention in a C++ kernel), entry point ``builtin_attention``."""
from __future__ import annotations

from collections.abc import Callable

import tandem
from tandem.plugins.attention_cpu import CpuAttentionBackend
from tandem.plugins.attention_torch import TorchAttentionBackend


@tandem.hookimpl
def tandem_register_attention_backends(register: Callable[[str, type], None]) -> None:
    register("torch", TorchAttentionBackend)
    register("cpu", CpuAttentionBackend)
