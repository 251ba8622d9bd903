"""Registers the "triton" attention backend: paged attention through tandem's Triton kernels.

The kernels are imported when the first backend instance is built, not when this module is:
the plugin manager imports it in every process, which must work without a GPU and without
triton, and Triton reads ``TRITON_INTERPRET`` when a kernel is defined.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import tandem
from tandem.hookspecs import Register
from tandem.interfaces import AttentionBackend, AttentionMetadata

SHAPE_KEY = "triton_attention_shape"


@functools.cache
def _kernels() -> SimpleNamespace:
    try:
        from tandem.kernels.kv_cache_write import write_kv_cache
        from tandem.kernels.paged_decode_attention import paged_decode_attention
        from tandem.kernels.paged_prefill_attention import paged_prefill_attention
    except ImportError as exc:
        raise ValueError(f"the 'triton' attention backend needs triton ({exc}); install it with "
                         "`pip install triton` or choose engine.attention_backend = 'torch'") from exc
    return SimpleNamespace(write_kv_cache=write_kv_cache, decode=paged_decode_attention,
                           prefill=paged_prefill_attention)


@dataclass(slots=True, frozen=True)
class _StepShape:
    """Per step: whether every sequence has exactly one query row (decode kernel), and how many
    leading rows belong to sequences (the rest are padding: slot -1, output zeros)."""

    decode: bool
    num_rows: int

    @classmethod
    def of(cls, metadata: AttentionMetadata) -> _StepShape:
        lens = metadata.query_lens_cpu
        return cls(decode=bool(lens) and all(n == 1 for n in lens), num_rows=sum(lens))


class TritonAttentionBackend(AttentionBackend):
    """Writes K/V with the kv_cache_write kernel, then runs paged decode attention when every
    sequence has exactly one query token and paged prefill attention otherwise. Rows past the
    sequences' query rows (padding of captured graphs) get zeros.

    ``metadata.extra["decode_num_splits"]``, when set, fixes the decode kernel's split count;
    otherwise it follows ``metadata.max_seq_len``, which a captured CUDA graph fixes at
    ``max_model_len`` (tandem.worker.cuda_graphs).
    """

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self._ops = _kernels()

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        metadata.extra[SHAPE_KEY] = _StepShape.of(metadata)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        ops = self._ops
        shape = metadata.extra.get(SHAPE_KEY) or _StepShape.of(metadata)
        ops.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        if shape.num_rows < out.shape[0]:
            out[shape.num_rows:].zero_()
        if shape.decode:
            rows = shape.num_rows
            ops.decode(query[:rows], kv_cache, metadata.block_tables, metadata.seq_lens, self.scale,
                       sliding_window=self.sliding_window,
                       num_splits=metadata.extra.get("decode_num_splits"),
                       max_seq_len=metadata.max_seq_len, out=out[:rows])
        else:
            ops.prefill(query, kv_cache, metadata.block_tables, metadata.query_start_loc,
                        metadata.seq_lens, metadata.max_query_len, self.scale,
                        sliding_window=self.sliding_window, out=out)
        return out


@tandem.hookimpl
def tandem_register_attention_backends(register: Register) -> None:
    register("triton", TritonAttentionBackend)
