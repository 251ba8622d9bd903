"""One rank's share of the model: its weights, its KV pool, its model runner, its CUDA graphs and
its KV connector.

A ``Worker`` is built in the process that runs it — the engine's own under the "uniproc"
executor, a worker process per rank under "mp" (tandem.executor.worker_process) — from the
configuration alone: it resolves the device and dtype, loads its share of the weights (the
parallel context, ``tandem.distributed.current()``, says which) through the quantization
method, allocates its block-major KV pool (its stage's layers, its KV heads; the same number of
blocks on every rank) and captures the decode graphs. It never sees the scheduler: each step it
gets the scheduler's diff (``SchedulerOutput``) and returns what the step sampled
(``ModelRunnerOutput``; only the driver rank's is not empty).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

import tandem
from tandem.config import ConfigError, TandemConfig, parse_bytes
from tandem.device import check_weights_fit, resolve_device, resolve_dtype
from tandem.distributed import current
from tandem.interfaces import KVConnector, KVPoolDescriptor
from tandem.kernels import cpu_ops
from tandem.models.config import ModelArchConfig, kv_bytes_per_block, kv_cache_shape, kv_shards
from tandem.models import cpu_tuning, huge_pages
from tandem.models.gguf_file import is_gguf
from tandem.plugin_manager import get_registry
from tandem.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("tandem")


def resolve_max_model_len(wanted: int | str, max_position_embeddings: int, num_kv_blocks: int,
                          block_size: int) -> int:
    """``model.max_model_len`` checked against the model and the KV pool ("auto": the smaller of
    the two); raises ValueError naming the field when it cannot be served."""
    capacity = (num_kv_blocks - 1) * block_size
    if wanted == "auto":
        if capacity < max_position_embeddings:
            logger.warning("max_model_len lowered from %d to %d tokens to fit the KV pool",
                           max_position_embeddings, capacity)
        return min(max_position_embeddings, capacity)
    if wanted > max_position_embeddings:
        raise ValueError(f"model.max_model_len = {wanted} exceeds the model's "
                         f"max_position_embeddings ({max_position_embeddings})")
    if wanted > capacity:
        raise ValueError(f"model.max_model_len = {wanted} tokens does not fit the KV pool "
                         f"({capacity} tokens); raise engine.num_kv_blocks/kv_cache_memory or "
                         "lower max_model_len")
    return wanted


def quant_method_for(config: TandemConfig, checkpoint: ModelArchConfig):
    """The quantization method ``model.quantization`` names ("auto": the checkpoint's own)."""
    qcfg = checkpoint.quantization_config or {}
    ckpt_method = qcfg.get("quant_method")
    chosen = config.model.quantization
    if chosen == "auto":
        chosen = ckpt_method or "unquantized"
    elif chosen == "none":
        chosen = "unquantized"
    if ckpt_method and chosen != ckpt_method:
        raise ValueError(f"model.quantization = {chosen!r} contradicts the checkpoint's "
                         f"quantization_config (quant_method = {ckpt_method!r})")
    cls = get_registry().get("quant_method", chosen)
    if cls.reads_gguf_blocks and not is_gguf(config.model.path):
        raise ConfigError(f"model.quantization = {chosen!r} keeps a GGUF file's blocks: it needs model.path "
                          f"to be a .gguf file, got {config.model.path!r} (use auto or none for it)")
    return cls.from_config(qcfg)


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """What the engine learns of a worker once it is built."""

    num_kv_blocks: int
    max_model_len: int


class Worker:
    """Builds and runs one rank. ``eos_token_ids`` are the generation config's (the sampler bans
    them before ``min_tokens``)."""

    def __init__(self, config: TandemConfig, eos_token_ids: frozenset[int]) -> None:
        from tandem.models.cpu_decode_loop import enable_cpu_decode_loop
        from tandem.models.cpu_fusion import enable_cpu_fusion
        from tandem.models.cuda_fusion import enable_cuda_fusion
        from tandem.models.cpu_linear import PAIR_KINDS, pack_cpu_linears
        from tandem.models.loader import estimate_weight_bytes, load_model
        from tandem.worker.model_runner import ModelRunner

        self.config = config
        self.parallel = current()
        eng, path = config.engine, config.model.path
        if eng.num_threads:
            torch.set_num_threads(eng.num_threads)
        torch.manual_seed(config.model.seed)
        checkpoint = ModelArchConfig.from_pretrained_dir(path)
        self.device = resolve_device(eng.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device, checkpoint.torch_dtype)
        backend = eng.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "cpu"
        registry = get_registry()
        self.attn_backend_cls = registry.get("attention_backend", backend)
        heads, kv_heads = checkpoint.num_attention_heads, checkpoint.num_key_value_heads
        if heads % self.parallel.tp_size == 0:  # else the model's load refuses the split, naming it
            self.attn_backend_cls = self.attn_backend_cls.for_model(
                config, self.dtype, heads // self.parallel.tp_size,
                self.parallel.num_local_kv_heads(kv_heads), checkpoint.head_dim,
                cpu_tuning.ChoiceCache("attention") if self.device.type == "cpu" else None)
        self.quant_method = quant_method = quant_method_for(config, checkpoint)
        weight_bytes = estimate_weight_bytes(path, self.dtype, packed=quant_method.reads_gguf_blocks)
        if weight_bytes is not None:
            weight_bytes //= self.parallel.world_size  # about each rank's share
        check_weights_fit(weight_bytes, self.device, self.dtype)
        t0 = time.perf_counter()
        self.model, self.arch = load_model(path, dtype=self.dtype, device=self.device, registry=registry,
                                           attn_backend_cls=self.attn_backend_cls, quant_method=quant_method)
        logger.info("loaded %s (%s) on %s in %s in %.1f s", path, self.arch.architectures[0], self.device,
                    str(self.dtype).removeprefix("torch."), time.perf_counter() - t0)
        lm_head_rows = eng.max_num_seqs * (1 + eng.num_speculative_tokens)
        cpu_kernels = pack_cpu_linears(self.model, eng.cpu_kernels, self.device, lm_head_rows) \
            in ("tandem", *PAIR_KINDS, "tuned") and cpu_ops.load()
        if self.device.type == "cpu" and tandem.OMP_POLICY_MISSED and torch.get_num_threads() > 1:
            logger.warning("torch was imported before tandem with OMP_WAIT_POLICY unset: OpenMP's idle "
                           "threads spin and take the cores from tandem's kernels (decode steps run "
                           "slower); import tandem first or set OMP_WAIT_POLICY=PASSIVE")
        if self.device.type == "cpu" and (moved := huge_pages.move_weights(self.model)):
            logger.info("weights: %.1f MiB on 2 MiB pages (transparent huge pages; TANDEM_CPU_HUGE_PAGES=0 "
                        "keeps 4 KiB pages)", moved / 2**20)
        if cpu_kernels:
            enable_cpu_fusion(self.model)
            if eng.cpu_decode_loop and enable_cpu_decode_loop(self.model):
                logger.info("decode steps: the decoder layers run as one C++ loop (engine.cpu_decode_loop)")
        if self.device.type == "cuda":
            enable_cuda_fusion(self.model)
        self.eos_token_ids = eos_token_ids
        self.kv_cache = self._allocate_kv_pool()
        self.info = WorkerInfo(self.kv_cache.shape[0], resolve_max_model_len(
            config.model.max_model_len, self.arch.max_position_embeddings, self.kv_cache.shape[0],
            eng.block_size))
        self.runner = ModelRunner(self.model, self.kv_cache, eng.block_size, eos_token_ids,
                                  self.attn_backend_cls, self.parallel, cpu_kernels=cpu_kernels)
        self.runner.graphs = self._capture_cuda_graphs()
        self.connector: KVConnector | None = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(out)

    def connect_kv(self, connector_name: str, compat_hash: str) -> KVConnector:
        """Register this rank's KV pool with a new connector of ``connector_name``."""
        assert self.connector is None, "the KV pool is registered once"
        connector = get_registry().get("kv_connector", connector_name)()
        connector.configure(self.config)
        par = self.parallel
        shards = kv_shards(self.arch, self.config.engine.block_size, self.dtype, par.tp_size, par.pp_size)
        connector.register_pool(self.kv_cache, KVPoolDescriptor.for_pool(self.kv_cache, compat_hash,
                                                                         shards, par.rank))
        self.connector = connector
        return connector

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()

    # ------------------------------------------------------------------ start-up

    def _num_kv_blocks(self) -> int:
        eng = self.config.engine
        if eng.num_kv_blocks is not None:
            return eng.num_kv_blocks
        block_bytes = kv_bytes_per_block(self.arch, eng.block_size, self.dtype, self.parallel)
        if eng.kv_cache_memory is not None:
            return parse_bytes(eng.kv_cache_memory) // block_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - eng.gpu_memory_utilization) * total
            return int(max(budget, 0) // block_bytes)
        return parse_bytes(eng.cpu_kv_cache_memory) // block_bytes

    def _allocate_kv_pool(self) -> torch.Tensor:
        bs = self.config.engine.block_size
        num_blocks = self._num_kv_blocks()
        if self.parallel.world_size > 1:  # block tables are shared: every rank holds the fewest
            blocks = torch.tensor([num_blocks], dtype=torch.int64)
            torch.distributed.all_reduce(blocks, torch.distributed.ReduceOp.MIN, group=self.parallel.cpu_group)
            num_blocks = int(blocks.item())
        if num_blocks < 2:
            raise ValueError(f"the KV pool holds {num_blocks} blocks; it needs at least 2 "
                             "(raise engine.num_kv_blocks or engine.kv_cache_memory)")
        shape = kv_cache_shape(self.arch, num_blocks, bs, self.parallel)
        if self.device.type == "cpu":  # on huge pages where the system gives them
            # written now, as torch.zeros would: no decode step pays the first touch of a page,
            # and a pool the machine cannot hold fails here, not in the middle of serving
            pool = huge_pages.HugePageArena().empty(shape, self.dtype).zero_()
        else:
            pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        logger.info("KV pool: %d blocks of %d tokens (%.1f MiB)", num_blocks, bs,
                    pool.numel() * pool.element_size() / 2**20)
        return pool

    def _capture_cuda_graphs(self):
        """On CUDA, unless enforce_eager or the backend cannot replay graphs: decode graphs at
        batch sizes up to min(max_num_seqs, cuda_graph_max_batch_size). A failed capture logs a
        warning and leaves the worker eager."""
        eng = self.config.engine
        if self.device.type != "cuda" or eng.enforce_eager:
            return None
        if self.parallel.pp_size > 1:
            logger.info("pipeline parallelism runs every step eagerly (no CUDA graphs)")
            return None
        if not self.attn_backend_cls.supports_cuda_graphs:
            logger.info("the %r attention backend does not support CUDA graphs: every step runs eagerly",
                        self.attn_backend_cls.name)
            return None
        from tandem.worker.cuda_graphs import DecodeGraphs, batch_size_buckets

        graphs = DecodeGraphs(self.model, self.kv_cache, eng.block_size, self.info.max_model_len,
                              batch_size_buckets(min(eng.max_num_seqs, eng.cuda_graph_max_batch_size)),
                              self.attn_backend_cls)
        try:
            graphs.capture()
        except Exception as exc:  # noqa: BLE001 - an eager worker beats no worker
            logger.warning("CUDA graph capture failed, every step runs eagerly (set "
                           "engine.enforce_eager = true to skip the attempt): %s: %s",
                           type(exc).__name__, exc)
            return None
        return graphs
