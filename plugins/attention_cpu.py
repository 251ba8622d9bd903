"""The "cpu" attention backend: the torch backend with attention read from the pool in place.

The KV writes are the torch backend's (tandem.plugins.attention_torch). Every query row of the
step (decodes, drafts being checked, and each token of a prefill or a chunk, after the step's K
and V are written) goes to the C++ kernel of ``tandem.kernels.cpu_ops`` as a one-query row that
sees the keys up to its own position: the kernel walks each row's block table over the pool
itself instead of gathering every sequence's context into a padded buffer per layer and masking
it, and a prefill is causal attention without a mask or a call per sequence (the rows of one
sequence read the same blocks, which stay in cache). Timings: docs/benchmarks.md.
Rows go to the threads one at a time from a shared counter, so long and short contexts even out
and a thread the OS holds up delays only its own row.

CPU only; where the kernel cannot be built (no compiler) it logs a warning once and runs the
torch backend's plan and paths, so the backend always runs. ``engine.attention_backend = "auto"``
picks it on the CPU.
"""
from __future__ import annotations

import torch

from tandem.interfaces import AttentionMetadata
from tandem.kernels import cpu_ops
from tandem.plugins.attention_torch import PLAN_KEY, TorchAttentionBackend, _StepPlan


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        if metadata.block_tables.device.type == "cpu" and cpu_ops.load():  # every row one query row
            metadata.extra[PLAN_KEY] = _StepPlan.build(metadata, decode_query_max=metadata.num_tokens)
        else:
            super().prepare_metadata(metadata)

    def _decode_into(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        if query.device.type != "cpu" or not cpu_ops.load():
            return super()._decode_into(out, query, kv_cache, plan)
        d = plan.decode
        tables = d.block_ids.view(d.rows.shape[0], d.num_blocks)
        cpu_ops.paged_decode(out, query, kv_cache, d.rows, tables, d.seq_lens, self.scale,
                             self.sliding_window or 0)
