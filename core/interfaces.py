"""The extension points of tandem: what a plugin implements, as ABCs and dataclasses.

Every folder may import this module (plugins, quant, transport), so it stays torch-free at run time:
torch appears only under TYPE_CHECKING. A plugin class is registered under a name through one of the
registration hooks of ``tandem.hookspecs`` and chosen by that name in the config; tandem instantiates
it once at start-up. No hook and no plugin method is called per token unless its contract says so.
"""
from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch


# --------------------------------------------------------------------------- scheduling policies


class SchedulableRequest(Protocol):
    """The read-only view of a request that policies and allocators see."""

    request_id: str
    priority: int
    arrival_time: float
    num_computed_tokens: int
    cache_salt: str | None  # prefix-cache blocks are shared only within one salt

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...


class SchedulingPolicy(ABC):
    """Decides order, not mechanism: which waiting request is admitted first, which running request
    is preempted when blocks run out, and optionally how many prompt tokens a step may admit.

    tandem's one Scheduler owns the token budget, chunked prefill, block allocation, preemption by
    recompute and aborts; a policy cannot break the KV accounting. Methods are called by the engine
    thread during ``Scheduler.schedule()`` and must be fast and side-effect free.
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def sort_key(self, request: SchedulableRequest) -> Any:
        """Admission order of waiting requests: smaller keys first. Called once when a request
        enters the waiting queue (again after a preemption); the key must not depend on time."""

    @abstractmethod
    def select_victim(self, running: Sequence[SchedulableRequest]) -> SchedulableRequest:
        """The running request to preempt when a running request cannot get a block.
        ``running`` is non-empty and in scheduling order; the victim may be the requester itself."""

    def should_preempt_for(self, waiting: SchedulableRequest, running: SchedulableRequest) -> bool:
        """Whether admitting ``waiting`` justifies preempting ``running`` (default: never)."""
        return False

    def max_prompt_tokens_per_step(self) -> int | None:
        """A cap on prompt tokens admitted per step (protects decode latency); None = no cap."""
        return None


# --------------------------------------------------------------------------- KV allocators


@dataclass(slots=True)
class KVAllocation:
    """What ``KVAllocator.allocate`` changed in one request's block table.

    ``new_block_ids`` were appended at the end; ``replaced_blocks`` are (logical index, new physical
    id) pairs where a shared partial block was copied on write; ``block_copies`` are the (src, dst)
    copies the runner must execute before the forward pass.
    """

    new_block_ids: list[int] = field(default_factory=list)
    replaced_blocks: list[tuple[int, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class KVStats:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVAllocator(ABC):
    """Paged KV bookkeeping: a block table per request over a pool of fixed-size blocks.

    Driven by the Scheduler on the engine thread only. Block 0 is the null block and is never
    handed out: ``num_blocks - 1`` blocks are usable. The allocator never changes a request's
    ``num_computed_tokens``; the Scheduler does.
    """

    name: ClassVar[str] = ""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_kv_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free plus evictable cached ones)."""

    @abstractmethod
    def get_num_cached_tokens(self, request: SchedulableRequest) -> int:
        """Tokens at the start of ``request`` whose KV sits in the prefix cache: a multiple of the
        block size, and always less than ``request.num_tokens`` (the last token is recomputed to get
        its logits). No side effects except counting the query."""

    @abstractmethod
    def allocate(
        self, request: SchedulableRequest, num_new_tokens: int, num_cached_tokens: int = 0
    ) -> KVAllocation | None:
        """Grow ``request``'s table to cover ``num_computed_tokens + num_cached_tokens +
        num_new_tokens`` tokens. ``num_cached_tokens`` (from ``get_num_cached_tokens``, first
        allocation only) attaches those cached blocks. Returns None and changes nothing when the
        free blocks do not suffice. Blocks that become full are registered in the prefix cache."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block ``request_id`` holds (no-op when it holds none)."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the same block table as ``parent_id``, sharing every block."""

    @abstractmethod
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (logical → physical), a copy."""

    @abstractmethod
    def stats(self) -> KVStats: ...

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request holds; returns how many (optional: 0)."""
        return 0

    def record_events(self) -> None:
        """From now on, record what enters and leaves the prefix cache for ``take_events``
        (``kv_events.enabled``; optional: an allocator that records nothing publishes nothing)."""

    def take_events(self) -> list:
        """The prefix-cache events (``tandem.sched.kv_events``) since the last call, oldest
        first. Called by the engine thread once per step; must be cheap."""
        return []

    def check_consistency(self) -> None:
        """Raise ``AssertionError`` naming the problem when the bookkeeping is inconsistent (a
        block's reference count against the tables holding it, the free list). Called by the
        engine after a failed step, not per step; optional (the default checks nothing)."""


# --------------------------------------------------------------------------- attention backends


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flattened batch as attention sees it (built once per step by the model runner).

    Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are its
    tokens at positions ``context_lens[i] .. seq_lens[i]-1``; its KV for positions
    ``0 .. seq_lens[i]-1`` lives in the blocks ``block_tables[i, :ceil(seq_lens[i]/block_size)]``.
    ``slot_mapping[t] = block_id * block_size + offset`` is where token ``t``'s K and V are
    written; -1 means write nothing. Tensors live on the model's device; the ``*_cpu`` lists are
    the same numbers as Python ints.
    """

    num_tokens: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Writes a layer's new K and V into the paged pool and attends over each sequence's context.

    The KV pool of an instance is one buffer laid out block-major::

        pool[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

    and a layer sees ``pool[:, layer]`` → ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``.
    One instance exists per attention layer; ``forward`` is called once per layer per step, by the
    model, inside the engine thread. Within a layer every write precedes every read, so a request
    may read blocks another request of the same batch writes in this step.
    """

    name: ClassVar[str] = ""
    supports_cuda_graphs: ClassVar[bool] = False
    """True when a decode step may be replayed from a CUDA graph (tandem.worker.cuda_graphs): the
    backend then reads sequence lengths, slots and block tables only from the metadata's device
    tensors, treats slot -1 as "write nothing" and a sequence of length 0 as padding, and
    launches the same kernels whatever those tensors hold."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``query [T, num_heads, head_dim]``, ``key``/``value [T, num_kv_heads, head_dim]``,
        ``kv_cache`` this layer's view of the pool. Returns ``[T, num_heads, head_dim]``: causal
        attention of each token over its own sequence's positions ≤ its own (within the sliding
        window when one is set)."""

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        """Once per step, before the forward pass: precompute backend-specific data into
        ``metadata.extra`` (optional)."""

    @classmethod
    def for_model(cls, config: Any, dtype: Any, num_heads: int, num_kv_heads: int, head_dim: int,
                  tuning: Any = None) -> type[AttentionBackend]:
        """The class an instance uses for a model whose attention layers have these heads
        (this rank's share) in ``dtype``, under ``config`` (a ``TandemConfig``): a backend that
        chooses among its own kernels by measurement returns a subclass holding the choice.
        ``tuning`` (a ``tandem.models.cpu_tuning.ChoiceCache`` on the CPU, else None) measures
        and caches such a choice: ``tuning.get(shape_key, compute)``, ``tuning.measure``.
        Called once at load, before the model is built; this default returns ``cls``."""
        return cls


# --------------------------------------------------------------------------- quantization


class QuantMethod(ABC):
    """How a linear layer stores its weights and computes ``x @ W.T + b``.

    The model asks the method to create a layer's parameters (``create_weights``), the loader hands
    each checkpoint tensor to ``load_weight``, ``process_weights_after_loading`` runs once after
    loading, and ``apply`` runs in every forward pass. A fused projection (QKV, gate/up) has several
    output shards, loaded from separate checkpoint tensors.
    """

    name: ClassVar[str] = ""
    reads_gguf_blocks: ClassVar[bool] = False
    """Reads only GGUF files, whose quantized tensors reach ``load_weight`` as the file stores
    them (``qweight`` blocks and their ``ggml_type``) instead of dequantized (``weight``)."""
    quantizes_embeddings: ClassVar[bool] = False
    """The token embedding and the LM head are linear layers of this method too (``embed``
    looks rows up); False keeps them plain tables in the model's dtype."""

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> QuantMethod:
        """Build from config.json's ``quantization_config`` (empty for unquantized models)."""
        return cls()

    @abstractmethod
    def create_weights(
        self, layer: Any, input_size: int, output_sizes: list[int], params_dtype: Any
    ) -> None:
        """Register the parameters of a linear layer of ``input_size`` inputs and
        ``sum(output_sizes)`` outputs (one size per fused shard) on ``layer``."""

    @abstractmethod
    def load_weight(self, layer: Any, name: str, tensor: Any, shard: int = 0) -> None:
        """Copy checkpoint tensor ``name`` (the suffix after the layer's prefix, e.g. "weight",
        "qweight", "scales") of output shard ``shard`` into ``layer``'s parameters."""

    def process_weights_after_loading(self, layer: Any) -> None:
        """Repack or convert after every tensor is loaded (optional)."""

    @abstractmethod
    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., input_size]`` → ``[..., sum(output_sizes)]``."""

    def embed(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``layer``'s weight, ``[*ids.shape, input_size]`` in the model's dtype:
        the token embedding of a method with ``quantizes_embeddings`` (only those implement it)."""
        raise NotImplementedError(f"the {self.name} quantization method keeps no embeddings")

    def split_axis(self, name: str, dim: str) -> tuple[int, int] | None:
        """Tensor parallelism: along which axis of checkpoint tensor ``name`` its ``dim``
        ("output" or "input") runs, and how many outputs or inputs one element along it covers
        (8 for a packed int4 word, the group size for per-group scales); None when the tensor
        does not vary along ``dim`` and every rank keeps it whole (a per-tensor scale). The
        default refuses: a method that does not say cannot run at tensor_parallel_size > 1."""
        raise ValueError(f"the {self.name or type(self).__name__} quantization method does not "
                         "support tensor parallelism")

    def split_tensor(self, name: str, tensor: Any, split: TensorSplit, logical_size: int) -> Any:
        """This rank's part of checkpoint tensor ``name`` of a shard with ``logical_size``
        outputs (``split.dim`` "output") or of a layer with ``logical_size`` inputs ("input"),
        cut as ``split_axis`` says. Raises ValueError naming the tensor and its shape when the
        parts would not hold whole elements (a group, a packed word, a scale block)."""
        axis_unit = self.split_axis(name, split.dim)
        if axis_unit is None or tensor.dim() == 0 or tensor.numel() == 1:
            return tensor
        axis, unit = axis_unit
        if logical_size % (split.parts * unit):
            raise ValueError(f"{name} of shape {tuple(tensor.shape)}: {logical_size} {split.dim}s do not "
                             f"split into {split.parts} parts of whole {unit}-{split.dim} elements")
        size = logical_size // split.parts // unit
        return tensor.narrow(axis, split.index * size, size)


@dataclass(frozen=True, slots=True)
class TensorSplit:
    """The part of a linear layer's checkpoint tensors one tensor-parallel rank keeps: its
    outputs ("output": column-parallel, each fused shard cut on its own) or inputs ("input":
    row-parallel) cut into ``parts`` equal ranges, of which it keeps range ``index``."""

    dim: str
    parts: int
    index: int


# --------------------------------------------------------------------------- KV connectors


def compat_hash(**fields: Any) -> str:
    """A short hash over what must agree for two instances to exchange KV blocks: pass the model
    name or path, dtype, number of layers, KV heads, head size and block size as keywords
    (JSON-serialisable values). Keyword order does not matter; any changed value changes it."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(slots=True, frozen=True)
class KVShard:
    """The part of the model's KV one rank's pool holds: layers ``[layer_start, layer_stop)`` (its
    pipeline stage's) and KV heads ``[head_start, head_stop)`` (its tensor-parallel share, or a
    replicated head) of the model's. One block of that pool is, in elements of ``itemsize``
    bytes::

        [layer_stop - layer_start][2: K, V][block_size tokens][head_stop - head_start][head_dim]
    """

    layer_start: int
    layer_stop: int
    head_start: int
    head_stop: int
    block_size: int
    head_dim: int
    itemsize: int

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_stop - self.head_start

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_heads * self.head_dim * self.itemsize

    def to_json(self) -> list[int]:
        return [self.layer_start, self.layer_stop, self.head_start, self.head_stop, self.block_size,
                self.head_dim, self.itemsize]

    @classmethod
    def from_json(cls, value: Any) -> KVShard:
        """Raises ValueError unless ``value`` is what ``to_json`` makes, with sane ranges."""
        if not (isinstance(value, list) and len(value) == 7 and all(type(v) is int for v in value)):
            raise ValueError(f"a KV shard is a list of 7 integers, not {value!r}"[:200])
        shard = cls(*value)
        if not (0 <= shard.layer_start < shard.layer_stop <= 1 << 16
                and 0 <= shard.head_start < shard.head_stop <= 1 << 16
                and 0 < shard.block_size <= 1 << 16 and 0 < shard.head_dim <= 1 << 16
                and shard.itemsize in (1, 2, 4, 8)):
            raise ValueError(f"KV shard {value!r} has an empty or insane range")
        return shard


@dataclass(slots=True, frozen=True)
class KVPoolDescriptor:
    """The KV pool as a connector registers it: one contiguous buffer, block-major, each block
    ``block_bytes`` long at ``base_address + block_id * block_bytes``::

        base_address
        |<- block 0 ->|<- block 1 ->| ... |<- block num_blocks-1 ->|
        each block = [num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] elements

    ``shards`` holds every rank's ``KVShard`` of the instance, in rank order, and ``rank`` is this
    pool's rank: a connector reads from a peer split another way by them. Empty: the layout is
    not known and only whole blocks of a peer split alike can be read.
    """

    base_address: int
    num_blocks: int
    block_bytes: int
    device: str
    compat_hash: str
    shards: tuple[KVShard, ...] = ()
    rank: int = 0

    def __post_init__(self) -> None:
        if self.shards and not (0 <= self.rank < len(self.shards)
                                and self.shards[self.rank].block_bytes == self.block_bytes):
            raise ValueError(f"rank {self.rank}'s KV shard does not describe blocks of "
                             f"{self.block_bytes} bytes")

    @property
    def shard(self) -> KVShard | None:
        return self.shards[self.rank] if self.shards else None

    @classmethod
    def for_pool(cls, pool: torch.Tensor, compat_hash: str, shards: Sequence[KVShard] | None = None,
                 rank: int = 0) -> KVPoolDescriptor:
        """Describe a contiguous block-major pool tensor ``[num_blocks, ...]``. Without
        ``shards``, a pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` is
        one rank holding the whole model's KV; a pool of another shape has no known layout."""
        if not pool.is_contiguous():
            raise ValueError("the KV pool must be one contiguous tensor")
        num_blocks = pool.shape[0]
        if shards is None:
            shards = ()
            if pool.dim() == 6 and pool.shape[2] == 2:
                _, layers, _, block_size, heads, head_dim = pool.shape
                shards = (KVShard(0, layers, 0, heads, block_size, head_dim, pool.element_size()),)
        return cls(
            base_address=pool.data_ptr(),
            num_blocks=num_blocks,
            block_bytes=pool.numel() * pool.element_size() // num_blocks,
            device=str(pool.device),
            compat_hash=compat_hash,
            shards=tuple(shards),
            rank=rank,
        )


@dataclass(slots=True, frozen=True)
class KVReadCounters:
    """What one rank's connector has read since it started: ``reads`` (transfers started with at
    least one block), ``descriptors`` (the (address, length) pairs those reads named) and
    ``bytes_read`` (their total length: exactly the KV its shard needs of the blocks read)."""

    reads: int = 0
    descriptors: int = 0
    bytes_read: int = 0


class KVPeerUnavailable(Exception):
    """Raised by ``KVConnector.add_peer`` for a compatible peer whose agent cannot be reached
    (it died, or restarted with new metadata behind the same handshake URL): a failed load, for
    ``kv_load_failure_policy`` to handle, not a bad hand-over."""


class KVConnector(ABC):
    """Moves KV blocks between instances. It knows block ids and bytes, nothing of requests'
    tokens, the scheduler or the runner. Failures are states the engine polls, never exceptions
    that unwind the step loop. Built with no arguments; every method is called from the engine
    thread, except ``handshake_info``, which any thread may call once the pool is registered.

    Pull model, one connector per instance::

        owner (prefill)                          reader (decode)
        register_pool(pool, desc)                register_pool(pool, desc)
        handshake_info() ── served over HTTP ──> peer = add_peer(info)       once per peer
        blocks pinned under transfer_id ──────> start_read(transfer_id, peer, remote, local, t)
                                                 poll() → {transfer_id: "done" | "error:..."}
        get_notifications() → [transfer_id] <── (sent when the read completes, or by
        → free the pinned blocks                  notify_release when nothing is read)

    ``transfer_id`` is the id the owner pinned the blocks under; the reader echoes it so the owner
    learns which blocks it may free. An owner that never hears back frees them at its own expiry.
    Instances split differently (tensor or pipeline parallel sizes) exchange KV by shard: each
    reading rank reads its layers and KV heads from the owner ranks that hold them
    (``KVPoolDescriptor.shards``, ``tandem.transport.shard_plan``).
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def register_pool(self, pool: Any, descriptor: KVPoolDescriptor) -> None:
        """Register the instance's KV pool once at start-up."""

    @abstractmethod
    def handshake_info(self) -> dict[str, Any]:
        """What a peer needs to read from this instance (agent metadata, addresses, layout,
        ``compat_hash``): a JSON-serialisable dict. It may change while the instance runs (a
        transport restarted with a new agent): the instance serves the current one."""

    @abstractmethod
    def add_peer(self, handshake: dict[str, Any]) -> str:
        """Make the instance that produced ``handshake`` readable; returns the peer name that
        ``start_read`` takes. Idempotent: adding a known peer again is cheap and returns the same
        name. ``handshake`` may list an instance's ranks (``"ranks"``). Raises ``ValueError`` with
        a message naming both sides when the peer's ``compat_hash`` differs from this
        instance's, or its ranks' shards cannot give this rank's layers and KV heads: its blocks
        would be garbage here, so no transfer may start; ``KVPeerUnavailable`` when the peer is
        compatible but cannot be reached."""

    @abstractmethod
    def start_read(
        self,
        transfer_id: str,
        peer: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        deadline_s: float,
    ) -> None:
        """Start reading ``remote_block_ids`` of ``peer`` into ``local_block_ids`` (pairwise) as
        one-sided reads; the transfer fails with "error:deadline" when it is not done
        ``deadline_s`` seconds from now. Transport failures are reported by ``poll``; a
        malformed call (lengths differ, ids out of range, duplicate local ids, a transfer_id
        still in flight) raises ``ValueError``."""

    @abstractmethod
    def poll(self) -> dict[str, str]:
        """States of transfers that changed: transfer_id → "done" or "error:<reason>" ("peer":
        the peer died or is unknown; "deadline"; "transfer": anything else), once each; from
        then on the transfer's local blocks are the caller's — except after "error:deadline":
        a read past its deadline may still write into them (a frozen peer that resumes; TCP
        cannot take back a request already sent), so they are the caller's only once a later
        poll reports the same transfer "closed" (the read completed late, or the peer is gone).
        Never raises."""

    @abstractmethod
    def get_notifications(self) -> list[str]:
        """Owner side: transfer ids whose reader finished (or gave up) since the last call."""

    @abstractmethod
    def notify_release(self, peer: str, transfer_id: str) -> None:
        """Reader side: tell ``peer`` that ``transfer_id``'s blocks will not be read (the request
        was aborted, or the prefix cache already held them). Never raises."""

    def configure(self, config: Any) -> None:
        """Called once, before ``register_pool``, with the instance's whole configuration
        (``tandem.config.TandemConfig``). Optional: the built-in transports need nothing of it;
        a wrapper such as "faulty" reads its section there."""

    def read_counters(self) -> list[KVReadCounters]:
        """Reader side: the ``KVReadCounters`` of each rank of this instance, in rank order (one
        for a single-process connector). Optional (the default counts nothing); never raises."""
        return [KVReadCounters()]

    def block_checksums(self, block_ids: list[int]) -> list[int] | None:
        """The checksum of each of ``block_ids`` of this instance's pool, as
        ``tandem.transport.kv_checksum`` defines it (the same on both sides of a hand-over,
        however each is split): an owner's goes with a hand-over, and a reader compares its own
        after a read reported "done" — a read that delivered part of a block is then a failed
        one. Optional: None (the default) when the connector cannot checksum its pool."""
        return None

    def event_counts(self) -> dict[str, int]:
        """Cumulative counts of connector-specific events by name, summed over the ranks (the
        "faulty" connector: the faults it injected). Optional (the default has none); never
        raises; may cross to the workers, so callers rate-limit it."""
        return {}

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` (it died, or is no longer used): its transfers end as "error:peer"
        ("closed" for those past their deadline); a later ``add_peer`` of its handshake makes it
        readable again. Called only for peers none of whose reads can still land. Optional (the
        default forgets nothing); never raises."""

    def close(self) -> None:
        """Release the transport's resources (optional; idempotent)."""


# --------------------------------------------------------------------------- executors


class Executor(ABC):
    """Runs the model for one engine: it owns the workers — each rank's share of the model, its
    KV pool, model runner, CUDA graphs and KV connector — wherever they run (the engine's own
    process, one process per rank, other hosts).

    Built once by the engine, from the configuration and the generation config's EOS ids; every
    method is called from the engine thread. Each step the engine calls ``execute`` with the
    scheduler's diff (``tandem.sched.output.SchedulerOutput``: new requests in full, running ones
    as ids, new blocks and new tokens) and gets the sampled tokens and logprobs back
    (``ModelRunnerOutput``). An exception from ``execute`` is a failed step, which the engine
    isolates; a worker that died or hangs is an ``EngineDeadError`` (tandem.engine).
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def __init__(self, config: Any, eos_token_ids: frozenset[int]) -> None:
        """Start the workers and wait until each has loaded its share of the model."""

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """Blocks of every rank's KV pool (the same on all ranks: block tables are shared)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The context length the workers serve (``model.max_model_len`` against the KV pool)."""

    @abstractmethod
    def execute(self, scheduler_output: Any) -> Any:
        """Run one step; returns the ``ModelRunnerOutput`` of the rank that samples."""

    @abstractmethod
    def connect_kv(self, connector_name: str, compat_hash: str) -> KVConnector:
        """Register the KV pools with a connector of ``connector_name`` (a prefill or decode
        instance, once at start-up); returns what the engine's hand-overs drive."""

    def check_health(self) -> None:
        """Called while the engine is idle, often: raise ``EngineDeadError`` when the workers
        died (optional; must be cheap — rate-limit anything that crosses a channel)."""

    def close(self) -> None:
        """Stop the workers and release what they hold (optional; idempotent)."""


# --------------------------------------------------------------------------- structured outputs


class StructuredOutputGrammar(ABC):
    """One sequence's place in its grammar: which tokens may come next, and the tokens taken.

    Used on the engine thread only (not thread-safe). A grammar starts before the sequence's
    first output token; ``accept_tokens`` advances it by the tokens the sequence gained, EOS
    included. Token masks are packed bits, the layout xgrammar and vLLM share::

        bitmask[row, w] (int32)   bit b (least significant first) allows token 32 * w + b
        shape [rows, ceil(vocab_size / 32)]; bits past vocab_size are 0
    """

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by ``token_ids`` in order; False (and the tokens from the first refused one
        on ignored) when one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (a numpy int32 array of the
        layout above). Once the grammar is complete only the stop tokens are allowed."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted after a complete output."""

    @abstractmethod
    def fork(self) -> StructuredOutputGrammar:
        """An independent copy at the same place (a sibling sequence of ``n > 1``)."""


class StructuredOutputBackend(ABC):
    """Turns ``StructuredOutputsParams`` (tandem.sampling_params) into grammars: xgrammar
    is built in; a plugin may add another (``tandem_register_structured_output_backends``),
    selected by ``engine.structured_output_backend``.

    Built once per engine, lazily, on the engine's compile thread, with the tokenizer (a
    transformers tokenizer), the model's vocabulary size (the width of its logits, which may
    exceed the tokenizer's) and the ids that end a sequence. ``validate`` runs where the request
    is admitted and must be cheap (parse, no token masks); ``compile`` may take long and runs on
    a worker thread, never the engine's step; both raise ``ValueError`` with a message a user
    can act on for a grammar they cannot serve. ``compile``'s result is opaque to tandem, which
    caches it by ``StructuredOutputsParams.key`` and may hand it to ``grammar`` many times,
    from the engine thread.
    """

    name: ClassVar[str] = ""

    @abstractmethod
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        """Prepare for this vocabulary (may take a second for a large one)."""

    @abstractmethod
    def validate(self, params: Any) -> None:
        """Raise ValueError when ``params`` is not a grammar this backend can compile."""

    @abstractmethod
    def compile(self, params: Any) -> Any:
        """Compile ``params`` (raise ValueError as ``validate`` does). Thread-safe."""

    @abstractmethod
    def grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh grammar at the start of ``compiled``."""

    def fill_bitmasks(self, grammars: list[StructuredOutputGrammar], bitmask: Any) -> None:
        """Fill ``bitmask[i]`` for ``grammars[i]`` (one step's batch; a backend may do it in
        parallel)."""
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)


# --------------------------------------------------------------------------- tool parsers


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    """One tool call found in a model's output, as far as the text goes: ``name`` is None until
    the function's name is complete; ``arguments`` is the JSON text of its arguments so far —
    the model's own characters, never reformatted, so that streamed fragments concatenate to the
    final text."""

    name: str | None
    arguments: str


@dataclass(slots=True, frozen=True)
class ToolCallParse:
    """A model's output split into ``content`` (the text meant for the user) and tool ``calls``."""

    content: str
    calls: tuple[ParsedToolCall, ...] = ()


class ToolParser(ABC):
    """Finds the tool calls in a model's output text, for ``tool_choice: "auto"`` (the server
    process, selected by ``server.tool_call_parser``; built once with no arguments, shared by
    every request: it must keep no state between calls)."""

    name: ClassVar[str] = ""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ToolCallParse:
        """Parse ``text``, the whole output so far; ``final`` when the output is complete.

        Called on the event loop, once per streamed chunk of every choice (with the text so far)
        and once at the end: must be fast and must not block. A non-final parse reports only
        what no continuation can change, so that a stream can send it at once: for a prefix
        ``t`` of ``u``, ``parse(t, False)``'s content is a prefix of ``parse(u, ...)``'s, its
        calls are a prefix of ``u``'s calls, and each call keeps its name once known and its
        arguments only grow. Text that cannot be tool calls (malformed JSON, a missing name)
        parses as ``ToolCallParse(text)``: all content, no calls (a stream that already sent
        calls keeps them)."""

    def cursor(self) -> Any:
        """Optional: a fresh ``tandem.server.tools.incremental.ToolCallCursor`` that streams
        one choice's calls reading each character once (what ``parse`` finds, as positions in
        the text). None (the default): a stream calls ``parse`` with the whole output on every
        chunk, which costs time quadratic in the output's length."""
        return None


# --------------------------------------------------------------------------- routing policies


@dataclass(slots=True, frozen=True)
class InstanceInfo:
    """An instance behind the router, as last seen by its health check."""

    url: str
    role: str
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_in_flight: int = 0
    """Requests the router has sent the instance and not yet seen finish (exact, current)."""


@dataclass(slots=True, frozen=True)
class RoutedPrompt:
    """A request's prompt as a cache-aware policy sees it. ``key``: what ``select`` gets;
    ``token_ids``: the ids the instances compute (from an instance's /tokenize, or the client's
    ids), None when the policy does not ask for them (``needs_token_ids``) or the router could not
    get them; ``cache_salt``: the request's, which seeds its blocks' hash chain."""

    key: Sequence[int]
    token_ids: Sequence[int] | None = None
    cache_salt: str | None = None


@dataclass(slots=True, frozen=True)
class RouterContext:
    """What the router tells its policies at start-up (``RoutingPolicy.start``):
    ``kv_secret`` is the cluster secret the instances' /kv/* routes ask for (None: none)."""

    kv_secret: str | None = None


class RoutingPolicy(ABC):
    """Picks the instance for a request, in the router process, once per request.

    Only ``select`` is required. A policy that follows the instances' state (their KV events)
    also implements the optional methods, all called on the router's event loop and none
    allowed to block: ``start``/``close`` around the router's life, ``rotation_changed`` when
    an instance enters or leaves rotation, ``select_prompt`` and ``cached_tokens`` per request."""

    name: ClassVar[str] = ""
    needs_token_ids: ClassVar[bool] = False
    """True: the router gets each prompt's token ids (an instance's /tokenize) for
    ``select_prompt`` and ``cached_tokens``."""

    def start(self, context: RouterContext) -> None:
        """Once, when the router starts (default: nothing)."""

    def close(self) -> None:
        """Once, when the router stops (default: nothing)."""

    def rotation_changed(self, url: str, in_rotation: bool) -> None:
        """``url`` entered or left rotation (health checks, a failed request, removal; default:
        nothing)."""

    def select_prompt(self, instances: Sequence[InstanceInfo], prompt: RoutedPrompt) -> InstanceInfo:
        """What the router calls per request; the default is ``select(instances, prompt.key)``."""
        return self.select(instances, prompt.key)

    def cached_tokens(self, url: str, prompt: RoutedPrompt) -> int | None:
        """How many leading prompt tokens ``url`` holds in its prefix cache, as far as the policy
        knows; None (the default) when it does not know. The router decodes a request in place,
        without a prefill hop, when the rest is under
        ``disaggregation.min_uncached_prefill_tokens``."""
        return None

    @abstractmethod
    def select(self, instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
        """``instances`` is non-empty and holds only healthy instances of the wanted role.
        The router does not tokenize: ``prompt_token_ids`` are the prompt's token ids when the
        client sent ids, else the UTF-8 bytes of its text (of a chat, each message's role and
        content). Called on the router's event loop: must be fast and must not block."""
