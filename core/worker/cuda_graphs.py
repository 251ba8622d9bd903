"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes.

An eager decode step of a small model on a fast GPU is bound by kernel launches, not by the GPU:
hundreds of small kernels per step, each a few microseconds of Python and driver work. A CUDA
graph records the launches of one forward pass once and replays them with one call. A graph
replays the same kernels on the same buffers, so a step must fit a recorded shape:

- every scheduled sequence has exactly one query token (pure decode; a prefill or a chunk runs
  eagerly), and there are at most ``max(batch_sizes)`` of them (more run eagerly);
- the step's inputs are copied into fixed buffers sized for the largest bucket; a batch of ``n``
  sequences replays the graph of the smallest bucket ``b >= n``, rows ``n..b-1`` being padding::

      row        input_id  position  slot  seq_len  block table
      0..n-1     token     p         s     p + 1    the request's blocks
      n..b-1     0         0         -1    0        stale (never read: seq_len 0)

  slot -1 writes no KV and a sequence of length 0 reads none, so padding rows touch nothing and
  their output rows are discarded;
- the attention backend must accept this: its class sets ``supports_cuda_graphs = True``. The
  graphs' metadata is fixed at capture: ``max_seq_len`` is ``max_model_len`` and
  ``query_lens_cpu`` all ones, so a backend may plan from those, but must read sequence lengths,
  slots and block tables from the device tensors (the "triton" backend does; its decode kernel
  takes its split count from ``max_seq_len``, so the grid stays fixed).

Graphs are captured largest first into one shared memory pool. With ``capture=False`` the same
buffers, padding and slicing run eagerly: the CPU tests use that to check everything but the
recording itself.
"""
from __future__ import annotations

import logging
import time

import torch

from tandem.interfaces import AttentionMetadata
from tandem.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch_size`` (which is always included)."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sizes + [max_batch_size]


class DecodeGraphs:
    """Fixed input buffers plus one captured graph of ``model``'s forward per batch size bucket.

    Call ``capture()`` once after the model is loaded and before serving;
    then per step ``can_run(inputs)`` and, when true, ``run(inputs)`` instead of the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        max_model_len: int,
        batch_sizes: list[int],
        attn_backend_cls: type,
        capture: bool = True,
    ) -> None:
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV pool is on {kv_cache.device}")
        if not getattr(attn_backend_cls, "supports_cuda_graphs", False):
            raise ValueError(f"the {attn_backend_cls.name!r} attention backend does not support "
                             "CUDA graphs (set engine.enforce_eager = true)")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(set(batch_sizes))
        self.attn_backend_cls = attn_backend_cls
        self.capture_graphs = capture
        self.num_replays = 0
        device = kv_cache.device
        n = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=device)
        self.metadata = {b: self._metadata(b) for b in self.batch_sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _metadata(self, b: int) -> AttentionMetadata:
        md = AttentionMetadata(
            num_tokens=b,
            slot_mapping=self.slot_mapping[:b],
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b,
        )
        self.attn_backend_cls.prepare_metadata(md)
        return md

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_cache, self.metadata[b])

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per bucket, largest first, sharing one memory pool. Each bucket runs
        once eagerly before its recording (Triton compiles its kernels then, not while recording).
        The buffers hold padding rows only, so neither run touches the KV pool."""
        if not self.capture_graphs:
            return
        t0 = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.kv_cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.batch_sizes):
                self._forward(b)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[b] = self._forward(b)
                pool = graph.pool() if pool is None else pool
                self.graphs[b] = graph
        torch.cuda.current_stream(self.kv_cache.device).wait_stream(stream)
        torch.cuda.synchronize(self.kv_cache.device)
        logger.info("captured %d CUDA graphs for decode (batch sizes %s) in %.1f s",
                    len(self.graphs), _ranges(self.batch_sizes), time.perf_counter() - t0)

    def can_run(self, inputs: StepInputs) -> bool:
        md = inputs.metadata
        return (0 < md.num_seqs <= self.max_batch_size and md.max_query_len == 1
                and md.num_tokens == md.num_seqs and md.block_tables.shape[1] <= self.max_blocks
                and md.max_seq_len <= self.max_model_len)

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.batch_sizes if b >= num_seqs)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The model's hidden states ``[n, hidden_size]`` for a step ``can_run`` accepted. The
        tensor is a view of the graph's output buffer: read it before the next ``run``."""
        md = inputs.metadata
        n = md.num_seqs
        b = self.bucket(n)
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.context_lens[:n].copy_(md.context_lens)
        self.block_tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables)
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].zero_()
            self.context_lens[n:b].zero_()
        self.num_replays += 1
        if self.capture_graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._forward(b)[:n]


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, … {sizes[-1]}"
