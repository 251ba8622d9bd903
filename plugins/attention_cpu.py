"""The "cpu" attention backend: the torch backend with decode attention read in place.

Everything but the batched decode call is the torch backend's (tandem.plugins.attention_torch):
the KV writes, prefill and chunked prefill through ``scaled_dot_product_attention``. The one-query
rows (decodes, drafts being checked, tiny chunks) go to the C++ kernel of
``tandem.kernels.cpu_ops``, which walks each row's block table over the pool itself
instead of gathering every sequence's context into a padded buffer per layer and masking it
(timings: docs/benchmarks.md). Rows go to the threads one at a time from a shared counter,
so long and short contexts even out and a thread the OS holds up delays only its own row.

CPU only; where the kernel cannot be built (no compiler) it logs a warning once and decodes
through the torch path, so the backend always runs. ``engine.attention_backend = "auto"``
picks it on the CPU.
"""
from __future__ import annotations

import torch

from tandem.kernels import cpu_ops
from tandem.plugins.attention_torch import TorchAttentionBackend, _StepPlan


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def _decode_into(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        if query.device.type != "cpu" or not cpu_ops.load():
            return super()._decode_into(out, query, kv_cache, plan)
        d = plan.decode
        tables = d.block_ids.view(d.rows.shape[0], d.num_blocks)
        cpu_ops.paged_decode(out, query, kv_cache, d.rows, tables, d.seq_lens, self.scale,
                             self.sliding_window or 0)
