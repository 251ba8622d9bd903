"""The "cpu" attention backend: the torch backend with attention read from the pool in place.

The KV writes go to the torch backend's rows of the pool (tandem.plugins.attention_torch), copied
row by row on tandem's threads (``cpu_ops.copy_rows``; torch's ``index_copy_`` where the kernels
do not build). Every query row of the
step (decodes, drafts being checked, and each token of a prefill or a chunk, after the step's K
and V are written) goes to the C++ kernel of ``tandem.kernels.cpu_ops`` as a one-query row that
sees the keys up to its own position: the kernel walks each row's block table over the pool
itself instead of gathering every sequence's context into a padded buffer per layer and masking
it, and a prefill is causal attention without a mask or a call per sequence (the rows of one
sequence read the same blocks, which stay in cache). Timings: docs/benchmarks.md.
Rows go to the threads one at a time from a shared counter, so long and short contexts even out
and a thread the OS holds up delays only its own row.

A long prompt is the exception: its rows each re-read the whole prefix, while torch's
``scaled_dot_product_attention`` takes the sequence block by block (GEMMs). From ``sdpa_rows``
query rows of one sequence in a step on, the sequence goes the torch backend's prefill way
(context gathered, SDPA); fewer rows stay on the kernel, where SDPA's per-call thread wake-ups
cost more than it saves. ``engine.cpu_prefill_attention`` picks the rule: ``auto`` measures the
crossing on this machine at the first start (``tuned_sdpa_rows``: both ways timed on one
sequence of ``PREFILL_ROWS[i]`` rows with no context and one with as much again before it;
SDPA from the smallest row count at and above which it was ``SWITCH_GAIN`` faster everywhere),
cached beside the linear kernels' choice and keyed like it; on a busy machine
``FIXED_SDPA_ROWS``, uncached. Decode rows always take the kernel.

CPU only; where the kernel cannot be built (no compiler) it logs a warning once and runs the
torch backend's plan and paths, so the backend always runs. ``engine.attention_backend = "auto"``
picks it on the CPU.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from tandem.interfaces import AttentionMetadata
from tandem.kernels import cpu_ops
from tandem.plugins.attention_torch import (DECODE_QUERY_MAX, PLAN_KEY, TorchAttentionBackend, _slot_rows, _StepPlan,
                                            _written)

logger = logging.getLogger("tandem")

PREFILL_ROWS = (64, 128, 256, 512, 1024)
"""Query rows of one sequence at which the kernel and SDPA are timed (``tuned_sdpa_rows``)."""
FIXED_SDPA_ROWS = 512
"""``sdpa_rows`` where nothing was measured (other processes kept the CPU busy)."""
SWITCH_GAIN = 1.1
"""How much faster SDPA must have been at a row count to take it (timing noise flips nothing)."""
BLOCK_SIZE = 16


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    sdpa_rows: ClassVar[int | None] = None
    """A sequence with at least this many query rows in a step attends through SDPA; None: every
    row through the kernel. ``for_model`` returns a subclass that sets it."""

    @classmethod
    def for_model(cls, config: Any, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                  tuning: Any = None) -> type[CpuAttentionBackend]:
        mode = config.engine.cpu_prefill_attention
        if mode == "paged" or not cpu_ops.load():
            rows, source = None, "engine.cpu_prefill_attention = paged" if mode == "paged" else "no kernel"
        elif mode == "sdpa":
            rows, source = DECODE_QUERY_MAX + 1, "engine.cpu_prefill_attention = sdpa"
        else:
            rows, source = tuned_sdpa_rows(tuning, dtype, num_heads, num_kv_heads, head_dim)
        if rows is None:
            logger.info("prefill attention: every query row through the paged kernel (%s)", source)
        else:
            logger.info("prefill attention: sequences of %d query rows or more in a step through torch's SDPA, "
                        "fewer through the paged kernel (%s)", rows, source)
        return type(cls.__name__, (cls,), {"sdpa_rows": rows, "__module__": cls.__module__, "__doc__": cls.__doc__})

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        if metadata.block_tables.device.type == "cpu" and cpu_ops.load():  # rows of the kernel, long ones SDPA
            limit = metadata.num_tokens if cls.sdpa_rows is None else max(cls.sdpa_rows - 1, DECODE_QUERY_MAX)
            metadata.extra[PLAN_KEY] = _StepPlan.build(metadata, decode_query_max=limit)
        else:
            super().prepare_metadata(metadata)

    @classmethod
    def _write(cls, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        if kv_cache.device.type != "cpu" or key.dtype != kv_cache.dtype or not cpu_ops.load():
            return super()._write(key, value, kv_cache, plan)
        rows, k_rows, v_rows = _slot_rows(kv_cache, plan)
        for src, index in zip(_written(key, value, plan), (k_rows, v_rows)):
            # copy_rows takes a row as one contiguous run (a slice of the qkv product is)
            cpu_ops.copy_rows(rows, index, src if src.shape[0] == 0 or src[0].is_contiguous() else src.contiguous())

    def _decode_into(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        if query.device.type != "cpu" or not cpu_ops.load():
            return super()._decode_into(out, query, kv_cache, plan)
        d = plan.decode
        cpu_ops.paged_decode(out, query, kv_cache, d.rows, d.tables, d.seq_lens, self.scale,
                             self.sliding_window or 0, d.row_tables)


# ---------------------------------------------------------------------------- the measured choice


def choose_sdpa_rows(paged: list[float], sdpa: list[float], rows: tuple[int, ...] = PREFILL_ROWS) -> int | None:
    """The fewest query rows from which SDPA goes first: the smallest ``rows[i]`` such that at
    it and at every larger count SDPA took at most 1 / SWITCH_GAIN of the kernel's time; None
    where it did not win at the largest."""
    chosen = None
    for i in reversed(range(len(rows))):
        if sdpa[i] * SWITCH_GAIN > paged[i]:
            break
        chosen = rows[i]
    return chosen


def tuned_sdpa_rows(tuning: Any, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int | None, str]:
    """``sdpa_rows`` for this attention shape on this machine and where it came from: measured
    once through ``tuning`` (``AttentionBackend.for_model``), then its cache; ``FIXED_SDPA_ROWS``
    where nothing was measured (no ``tuning``, a busy machine)."""
    if tuning is None:
        return FIXED_SDPA_ROWS, "the fixed rule"
    # the kernel's own build in the key: a change to it (its prompt rows on AMX tiles) moves the crossing
    shape = f"{str(dtype).removeprefix('torch.')}:{num_heads}x{num_kv_heads}x{head_dim}:{cpu_ops.attention_build()}"

    def compute() -> dict:
        seconds = measure(dtype, num_heads, num_kv_heads, head_dim, tuning.measure)
        return {"sdpa_rows": choose_sdpa_rows(seconds["paged"], seconds["sdpa"]), "rows": list(PREFILL_ROWS),
                "us": {k: [round(t * 1e6, 1) for t in v] for k, v in seconds.items()}}

    entry, source = tuning.get(shape, compute)
    if entry is None:
        logger.warning("prefill attention: %s while tandem meant to time it; SDPA from %d rows (the fixed rule, "
                       "measured again at the next start)", source, FIXED_SDPA_ROWS)
        return FIXED_SDPA_ROWS, "the fixed rule"
    rows = entry.get("sdpa_rows", FIXED_SDPA_ROWS)
    return (rows if rows is None or isinstance(rows, int) else FIXED_SDPA_ROWS), source  # a hand-edited cache


def measure(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            timer: Callable[..., dict[str, list[float]]]) -> dict[str, list[float]]:
    """Seconds of one layer's attention, kernel rows against SDPA, for a step of two sequences of
    each ``PREFILL_ROWS`` count of query rows (one with no context, one with as many tokens
    before it), on a random pool: ``timer(candidates, inputs)``'s fastest interleaved runs
    (``cpu_tuning.measure``, handed over as ``ChoiceCache.measure``)."""
    gen = torch.Generator().manual_seed(0)
    most = max(PREFILL_ROWS)
    blocks = 1 + 3 * most // BLOCK_SIZE
    pool = torch.randn(blocks, 2, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    steps = []
    for m in PREFILL_ROWS:
        n = 2 * m
        qkv = torch.randn(n, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        steps.append((_two_sequences(m), qkv))
    kinds = {"paged": None, "sdpa": DECODE_QUERY_MAX + 1}
    candidates = {}
    for kind, rows in kinds.items():
        backend = type("Timed", (CpuAttentionBackend,), {"sdpa_rows": rows})(
            num_heads, num_kv_heads, head_dim, head_dim**-0.5)

        def run(step: tuple[AttentionMetadata, torch.Tensor], backend: CpuAttentionBackend = backend) -> None:
            md, qkv = step
            md.extra.clear()
            type(backend).prepare_metadata(md)
            q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
            backend.forward(q, k, v, pool, md)

        candidates[kind] = run
    with torch.inference_mode():
        return timer(candidates, steps)


def _two_sequences(m: int) -> AttentionMetadata:
    """A step of two sequences of ``m`` query rows each: one with no context (blocks from 1), one
    with ``m`` tokens before it (the blocks after), block tables contiguous."""
    specs = [(0, m), (m, m)]
    tables, slots, first = [], [], 1
    for context, rows in specs:
        count = -(-(context + rows) // BLOCK_SIZE)
        table = list(range(first, first + count))
        first += count
        tables.append(table)
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context, context + rows)]
    width = max(len(t) for t in tables)
    seq_lens = [c + r for c, r in specs]
    return AttentionMetadata(
        num_tokens=len(slots),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor([0, m, 2 * m], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in specs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=m,
        max_seq_len=max(seq_lens),
        block_size=BLOCK_SIZE,
        query_lens_cpu=[m, m],
        seq_lens_cpu=seq_lens,
    )
