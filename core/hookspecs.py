"""Hook specifications of tandem's plugin core (pluggy project name ``"tandem"``).

Every registration hook receives a ``register(name, cls)`` callable and is called once per process
at start-up (router, prefill and decode instances alike), when the plugin manager loads the
installed plugins. Registering a name twice is a start-up error naming both plugins. Each hook is
documented for plugin authors in docs/plugins.md; a test fails when a hook has no section there.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("tandem")

Register = Callable[[str, type], None]


@hookspec
def tandem_register_schedulers(register: Register) -> None:
    """Register scheduling policies: ``register("fcfs", FCFSPolicy)``.

    Each class subclasses ``tandem.interfaces.SchedulingPolicy`` and is built with no arguments.
    Selected by ``engine.scheduler`` in the config."""


@hookspec
def tandem_register_kv_allocators(register: Register) -> None:
    """Register KV allocators: ``register("paged", PagedKVAllocator)``.

    Each class subclasses ``tandem.interfaces.KVAllocator`` and is built as
    ``cls(num_blocks, block_size, enable_prefix_caching)``. Selected by ``engine.kv_allocator``."""


@hookspec
def tandem_register_attention_backends(register: Register) -> None:
    """Register attention backends: ``register("torch", TorchAttentionBackend)``.

    Each class subclasses ``tandem.interfaces.AttentionBackend``; one instance per attention layer.
    Selected by ``engine.attention_backend``."""


@hookspec
def tandem_register_quant_methods(register: Register) -> None:
    """Register quantization methods: ``register("gptq", GPTQMethod)``.

    Each class subclasses ``tandem.interfaces.QuantMethod`` and is built with
    ``cls.from_config(quantization_config)``. Selected by ``model.quantization`` or by the
    checkpoint's ``quantization_config.quant_method``."""


@hookspec
def tandem_register_kv_connectors(register: Register) -> None:
    """Register KV connectors: ``register("nixl", NixlConnector)``.

    Each class subclasses ``tandem.interfaces.KVConnector``. Selected by
    ``disaggregation.kv_connector``."""


@hookspec
def tandem_register_routing_policies(register: Register) -> None:
    """Register routing policies for the router: ``register("round_robin", RoundRobin)``.

    Each class subclasses ``tandem.interfaces.RoutingPolicy`` and is built with no arguments."""


@hookspec
def tandem_register_models(register: Register) -> None:
    """Register model classes by the architecture name of config.json's ``architectures``:
    ``register("LlamaForCausalLM", LlamaForCausalLM)``."""


@hookspec
def tandem_register_executors(register: Register) -> None:
    """Register executors, selected by ``engine.distributed_executor_backend``:
    ``register("uniproc", UniprocExecutor)``.

    Each class subclasses ``tandem.interfaces.Executor`` and is built by the engine with
    ``(config, eos_token_ids)``."""


@hookspec
def tandem_register_structured_output_backends(register: Register) -> None:
    """Register structured-output (constrained decoding) backends, selected by
    ``engine.structured_output_backend``: ``register("xgrammar", XGrammarBackend)``.

    Each class subclasses ``tandem.interfaces.StructuredOutputBackend`` and is built by the
    engine process with ``(tokenizer, vocab_size, stop_token_ids)`` when the first constrained
    request arrives."""


@hookspec
def tandem_register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers for ``tool_choice: "auto"``: ``register("hermes",
    HermesToolParser)``.

    Each class subclasses ``tandem.interfaces.ToolParser`` and is built with no arguments, once
    per server process. Selected by ``server.tool_call_parser`` (``--tool-call-parser``)."""


@hookspec
def tandem_engine_started(config: Any) -> None:
    """Observer: called once in each engine process after the model is loaded and the KV pool is
    allocated, with the effective ``TandemConfig``. The return value is ignored; an
    implementation that raises is logged and skipped."""


@hookspec
def tandem_request_finished(request_id: str, finish_reason: str, num_prompt_tokens: int,
                            num_output_tokens: int) -> None:
    """Observer: called in the engine process once per finished request (any reason, including
    "abort" and "error"), after its blocks are freed. Keep it fast: it runs on the engine thread.
    An implementation that raises is logged and skipped."""
