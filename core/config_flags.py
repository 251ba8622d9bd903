"""The configuration flags of the command line, built from the config schema (tandem.config).

``CONFIG_FLAGS`` names one flag per config field the command line may set (shaped like ``vllm
serve``); ``add_config_flags`` adds them to a parser, taking each one's help, default and
choices from the field, and ``flags_to_overrides`` turns the ones the user set into
``load_config`` overrides. Every subcommand that builds an engine (tandem.cli, the launch
modules of the server and the router) adds the same flags from here.
"""
from __future__ import annotations

import argparse
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from tandem.config import SECTIONS, ConfigError


@dataclass(frozen=True, slots=True)
class ConfigFlag:
    """A command-line flag that overrides the config field ``key`` ("section.field"); ``type``
    None makes it a ``--flag/--no-flag`` switch."""

    flag: str
    key: str
    type: Callable[[str], Any] | None = str
    metavar: str | None = None
    short: str | None = None


CONFIG_FLAGS = [
    ConfigFlag("--model", "model.path", metavar="PATH"),
    ConfigFlag("--tokenizer", "model.tokenizer", metavar="PATH"),
    ConfigFlag("--served-model-name", "model.served_model_name", metavar="NAME"),
    ConfigFlag("--dtype", "model.dtype"),
    ConfigFlag("--quantization", "model.quantization", metavar="NAME"),
    ConfigFlag("--max-model-len", "model.max_model_len", metavar="N|auto"),
    ConfigFlag("--seed", "model.seed", int, "N"),
    ConfigFlag("--generation-config", "model.generation_config", metavar="auto|vllm|FOLDER"),
    ConfigFlag("--device", "engine.device", metavar="DEVICE"),
    ConfigFlag("--block-size", "engine.block_size", int, "N"),
    ConfigFlag("--num-kv-blocks", "engine.num_kv_blocks", int, "N"),
    ConfigFlag("--kv-cache-memory", "engine.kv_cache_memory", metavar="BYTES"),
    ConfigFlag("--gpu-memory-utilization", "engine.gpu_memory_utilization", float, "FRACTION"),
    ConfigFlag("--max-num-seqs", "engine.max_num_seqs", int, "N"),
    ConfigFlag("--max-num-batched-tokens", "engine.max_num_batched_tokens", int, "N"),
    ConfigFlag("--enable-prefix-caching", "engine.enable_prefix_caching", None),
    ConfigFlag("--enable-chunked-prefill", "engine.enable_chunked_prefill", None),
    ConfigFlag("--scheduler", "engine.scheduler", metavar="NAME"),
    ConfigFlag("--kv-allocator", "engine.kv_allocator", metavar="NAME"),
    ConfigFlag("--attention-backend", "engine.attention_backend", metavar="NAME"),
    ConfigFlag("--enforce-eager", "engine.enforce_eager", None),
    ConfigFlag("--cpu-kernels", "engine.cpu_kernels"),
    ConfigFlag("--cpu-prefill-attention", "engine.cpu_prefill_attention"),
    ConfigFlag("--cpu-decode-loop", "engine.cpu_decode_loop", None),
    ConfigFlag("--num-speculative-tokens", "engine.num_speculative_tokens", int, "N"),
    ConfigFlag("--distributed-executor-backend", "engine.distributed_executor_backend", metavar="NAME"),
    ConfigFlag("--structured-output-backend", "engine.structured_output_backend", metavar="NAME"),
    ConfigFlag("--worker-timeout-s", "engine.worker_timeout_s", float, "SECONDS"),
    ConfigFlag("--tensor-parallel-size", "parallel.tensor_parallel_size", int, "N", "-tp"),
    ConfigFlag("--pipeline-parallel-size", "parallel.pipeline_parallel_size", int, "N", "-pp"),
    ConfigFlag("--nnodes", "parallel.nnodes", int, "N"),
    ConfigFlag("--node-rank", "parallel.node_rank", int, "N"),
    ConfigFlag("--master-addr", "parallel.master_addr", metavar="HOST"),
    ConfigFlag("--master-port", "parallel.master_port", int, "PORT"),
    ConfigFlag("--max-logprobs", "engine.max_logprobs", int, "N"),
    ConfigFlag("--host", "server.host", metavar="HOST"),
    ConfigFlag("--port", "server.port", int, "N"),
    ConfigFlag("--api-key", "server.api_key", metavar="KEY"),
    ConfigFlag("--api-key-file", "server.api_key_file", metavar="PATH"),
    ConfigFlag("--max-queued-requests", "server.max_queued_requests", int, "N"),
    ConfigFlag("--max-queued-tokens", "server.max_queued_tokens", int, "N"),
    ConfigFlag("--shutdown-timeout-s", "server.shutdown_timeout_s", float, "SECONDS"),
    ConfigFlag("--stream-stall-timeout-s", "server.stream_stall_timeout_s", float, "SECONDS"),
    ConfigFlag("--log-requests", "server.log_requests", None),
    ConfigFlag("--enable-auto-tool-choice", "server.enable_auto_tool_choice", None),
    ConfigFlag("--tool-call-parser", "server.tool_call_parser", metavar="NAME"),
    ConfigFlag("--max-request-body-bytes", "server.max_request_body_bytes", int, "N"),
    ConfigFlag("--max-prompt-chars", "server.max_prompt_chars", int, "N"),
    ConfigFlag("--max-messages", "server.max_messages", int, "N"),
    ConfigFlag("--max-prompts", "server.max_prompts", int, "N"),
    ConfigFlag("--max-abs-priority", "server.max_abs_priority", int, "N"),
    ConfigFlag("--header-timeout-s", "server.header_timeout_s", float, "SECONDS"),
    ConfigFlag("--keep-alive-timeout-s", "server.keep_alive_timeout_s", float, "SECONDS"),
    ConfigFlag("--max-connections", "server.max_connections", int, "N"),
    ConfigFlag("--role", "disaggregation.role"),
    ConfigFlag("--kv-transfer-secret-file", "disaggregation.kv_transfer_secret_file", metavar="PATH"),
    ConfigFlag("--router-admin-key-file", "disaggregation.router_admin_key_file", metavar="PATH"),
    ConfigFlag("--min-uncached-prefill-tokens", "disaggregation.min_uncached_prefill_tokens", int, "N"),
    ConfigFlag("--kv-events", "kv_events.enabled", None),
    ConfigFlag("--kv-events-endpoint", "kv_events.endpoint", metavar="ZMQ_ADDRESS"),
    ConfigFlag("--kv-events-replay-endpoint", "kv_events.replay_endpoint", metavar="ZMQ_ADDRESS"),
]
_POSITIONAL_MODEL = "model_path_positional"


def add_config_flags(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Add ``--config FILE`` and one flag per ``CONFIG_FLAGS`` entry (plus the model path as an
    optional first positional argument) to ``parser``. Every flag defaults to None: unset."""
    group = parser.add_argument_group(
        "configuration", "Override the config file and TANDEM_* environment variables."
    )
    group.add_argument("--config", dest="config_file", metavar="FILE",
                       help="TOML config file (see examples/config.toml)")
    if positional_model:
        parser.add_argument(_POSITIONAL_MODEL, nargs="?", metavar="MODEL",
                            help="model folder, .gguf file or preset name (demo, bench-100m), the same "
                                 "as --model")
    for flag in CONFIG_FLAGS:
        names = (flag.flag, flag.short) if flag.short else (flag.flag,)
        group.add_argument(*names, dest=flag.key, help=_flag_help(flag), **_flag_options(flag))


def _field(key: str) -> Any:
    section, name = key.split(".")
    return SECTIONS[section].model_fields[name]


def _flag_options(flag: ConfigFlag) -> dict[str, Any]:
    if flag.type is None:
        return {"action": argparse.BooleanOptionalAction, "default": None}
    annotation = _field(flag.key).annotation
    is_enum = isinstance(annotation, type) and issubclass(annotation, enum.Enum)
    choices = tuple(member.value for member in annotation) if is_enum else get_args(annotation)
    if choices and all(isinstance(c, str) for c in choices):
        return {"type": flag.type, "choices": choices, "default": None}
    return {"type": flag.type, "metavar": flag.metavar, "default": None}


def _flag_help(flag: ConfigFlag) -> str:
    field = _field(flag.key)
    default = field.default_factory() if field.default_factory else field.default
    shown = "unset" if default is None else default
    return f"{field.description} [{flag.key}, default: {shown}]".replace("%", "%%")


def flags_to_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``load_config`` overrides of the flags the user set (unset flags are left out).
    Raises ``ConfigError`` when the positional model and ``--model`` disagree."""
    overrides = {flag.key: getattr(args, flag.key) for flag in CONFIG_FLAGS
                 if getattr(args, flag.key, None) is not None}
    positional = getattr(args, _POSITIONAL_MODEL, None)
    if positional is not None:
        if overrides.setdefault("model.path", positional) != positional:
            raise ConfigError(f"two different models given: {positional!r} and --model "
                              f"{overrides['model.path']!r}")
    return overrides
