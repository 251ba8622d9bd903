"""The torch attention backend: paged KV writes plus ``scaled_dot_product_attention``.

Runs wherever torch runs (CPU and CUDA; float32, float16, bfloat16). Per layer and step:

1. Write the K and V of every token at its slot (``slot_mapping``; -1 writes nothing)::

       pool[:, layer] = [num_blocks, 2, block_size, num_kv_heads, head_dim]
       slot s → block s // block_size, offset s % block_size, for K (index 0) and V (index 1)

2. Attend. Every query row of a sequence with at most ``DECODE_QUERY_MAX`` of them (a decode,
   drafts being checked, a tiny chunk) goes into ONE batched SDPA call as a one-query sequence
   ending at its own position: its blocks are gathered through the block table into
   ``[B, max_blocks * block_size, Hkv, D]`` and keys past that position are masked. The query
   heads of one KV head ride as that head's "query rows" (``[B, Hkv, G, D]``), so GQA needs no
   copy of K/V. Longer sequences (prefill, chunked prefill, extend) get one SDPA call each:
   causal over the fresh K/V when they have no cached prefix, else over their gathered context
   with an explicit mask (in pieces of query rows where that mask would pass MAX_MASK_BYTES).

Query row ``t`` of a sequence sits at position ``p = context_len + t`` and sees key positions
``k <= p``, and with a sliding window ``W`` only ``k > p - W`` (HF's Mistral semantics: the last
W positions, itself included). ``prepare_metadata`` turns the step's metadata into index tensors
once; masks are built on first use and shared by every layer of the step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from tandem.interfaces import AttentionBackend, AttentionMetadata

PLAN_KEY = "torch_attention_plan"
# Sequences with at most this many query rows go through the batched decode call, one row each.
DECODE_QUERY_MAX = 8
MAX_MASK_BYTES = 32 << 20
"""A prefill's explicit mask ([query rows, keys]) is kept under this many bytes: beyond it the
query rows go in pieces, each over the keys up to its own last position (a 2,048-token chunk of a
128K context would otherwise take a 1 GiB float32 mask)."""


@dataclass(slots=True)
class _PrefillSeq:
    """A sequence with several query tokens: rows ``start:end`` at positions ``context_len..``."""

    start: int
    end: int
    context_len: int
    seq_len: int
    block_ids: torch.Tensor


@dataclass(slots=True)
class _DecodeBatch:
    """One-query rows: their token rows and visible keys ``[N]``, the step's block tables cut to
    ``num_blocks`` columns ``[S, num_blocks]`` (int64; padding entries point at block 0, masked
    out), and ``row_tables`` ``[N]``, the table of each row (None: row ``i`` takes table ``i``).
    A prefill's rows share their sequence's table instead of a copy each."""

    rows: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor
    row_tables: torch.Tensor | None
    num_blocks: int
    _block_ids: torch.Tensor | None = None

    @property
    def block_ids(self) -> torch.Tensor:
        """Each row's table, flattened ``[N * num_blocks]`` (the torch path gathers by it; built
        once a step)."""
        if self._block_ids is None:
            rows = self.tables if self.row_tables is None else self.tables.index_select(0, self.row_tables)
            self._block_ids = rows.reshape(-1)
        return self._block_ids


@dataclass(slots=True)
class _StepPlan:
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor
    padded: bool
    decode: _DecodeBatch | None
    prefills: list[_PrefillSeq]
    block_size: int
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)
    buffers: dict[tuple, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def build(cls, md: AttentionMetadata, decode_query_max: int = DECODE_QUERY_MAX) -> _StepPlan:
        """The step's plan: sequences with at most ``decode_query_max`` query rows go into the
        batched one-query-row call, the others get a prefill call each."""
        bs = md.block_size
        slots = md.slot_mapping.long()
        write_rows = None
        if slots.numel() and int(slots.min()) < 0:  # padding rows (CUDA graphs) write nothing
            write_rows = (slots >= 0).nonzero().squeeze(1)
            slots = slots[write_rows]
        starts = [0, *accumulate(md.query_lens_cpu)]
        # Every query row of a short sequence (a decode, drafts being checked, a tiny chunk) joins
        # the batched decode call as a one-query sequence ending at its own position.
        rows: list[int] = []
        row_seqs: list[int] = []
        row_seq_lens: list[int] = []
        for i, n in enumerate(md.query_lens_cpu):
            if n <= decode_query_max:
                context = md.seq_lens_cpu[i] - n
                rows.extend(range(starts[i], starts[i] + n))
                row_seqs.extend([i] * n)
                row_seq_lens.extend(range(context + 1, context + n + 1))
        prefills = [
            _PrefillSeq(starts[i], starts[i + 1], md.seq_lens_cpu[i] - n, md.seq_lens_cpu[i],
                        md.block_tables[i, : -(-md.seq_lens_cpu[i] // bs)].long())
            for i, n in enumerate(md.query_lens_cpu) if n > decode_query_max
        ]
        return cls(
            write_rows=write_rows,
            write_slots=slots,
            padded=starts[-1] < md.num_tokens,
            decode=cls._decode_batch(md, rows, row_seqs, row_seq_lens) if rows else None,
            prefills=prefills,
            block_size=bs,
        )

    @staticmethod
    def _decode_batch(md: AttentionMetadata, rows: list[int], row_seqs: list[int],
                      row_seq_lens: list[int]) -> _DecodeBatch:
        device = md.block_tables.device
        num_blocks = -(-max(row_seq_lens) // md.block_size)
        tables = md.block_tables[:md.num_seqs, :num_blocks].to(torch.long, copy=True).clamp_(min=0)
        one_each = row_seqs == list(range(md.num_seqs))  # one row for each sequence, in order
        index = rows + row_seq_lens + ([] if one_each else row_seqs)
        index_t = torch.tensor(index, dtype=torch.long, device=device)
        n = len(rows)
        return _DecodeBatch(
            rows=index_t[:n],
            seq_lens=index_t[n:2 * n],
            tables=tables,
            row_tables=None if one_each else index_t[2 * n:],
            num_blocks=num_blocks,
        )

    def write_index(self, rows_per_block: int, v_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of the K and V of each written token in a layer's pool seen as rows of
        ``rows_per_block`` per block, V ``v_offset`` rows after K (computed once a step)."""
        key = ("write", rows_per_block, v_offset)
        if key not in self.buffers:
            k_rows = self.write_slots // self.block_size * rows_per_block + self.write_slots % self.block_size
            self.buffers[key] = (k_rows, k_rows + v_offset)
        return self.buffers[key]

    def decode_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, 1, num_blocks * block_size]``: key k of row b is visible iff
        ``k < seq_len[b]`` (and ``k >= seq_len[b] - window``)."""
        key = ("decode", window, dtype)
        if key not in self.masks:
            d = self.decode
            seq_lens = d.seq_lens[:, None]
            key_pos = torch.arange(d.num_blocks * self.block_size, device=seq_lens.device)[None, :]
            visible = key_pos < seq_lens
            if window is not None:
                visible &= key_pos >= seq_lens - window
            self.masks[key] = _additive(visible, dtype)[:, None, None, :]
        return self.masks[key]

    def prefill_mask(self, index: int, window: int | None, dtype: torch.dtype, rows: tuple[int, int] | None = None
                     ) -> torch.Tensor:
        """Additive mask ``[query_len, seq_len]`` of prefill sequence ``index`` (built once a step);
        with ``rows`` = (a, b), that of its query rows a..b-1 over the keys up to row b-1's
        position, ``[b - a, context_len + b]`` (built on each call: pieces are not kept)."""
        key = ("prefill", index, window, dtype)
        if rows is None and key in self.masks:
            return self.masks[key]
        seq = self.prefills[index]
        a, b = rows if rows is not None else (0, seq.seq_len - seq.context_len)
        device = seq.block_ids.device
        query_pos = torch.arange(seq.context_len + a, seq.context_len + b, device=device)[:, None]
        key_pos = torch.arange(seq.context_len + b, device=device)[None, :]
        visible = key_pos <= query_pos
        if window is not None:
            visible &= key_pos > query_pos - window
        mask = _additive(visible, dtype)
        if rows is None:
            self.masks[key] = mask
        return mask

    def gather(self, kv_cache: torch.Tensor, kv: int, block_ids: torch.Tensor, key: tuple) -> torch.Tensor:
        """``[len(block_ids), block_size, Hkv, D]``: the blocks' K (kv=0) or V (kv=1), copied into a
        buffer that every layer of the step reuses (a fresh multi-MB tensor per layer costs more
        in page faults on the CPU than the copy itself)."""
        source = kv_cache[:, kv]
        buf_key = (kv, *key, source.dtype)
        buf = self.buffers.get(buf_key)
        if buf is None:
            buf = torch.empty((block_ids.shape[0], *source.shape[1:]), dtype=source.dtype, device=source.device)
            self.buffers[buf_key] = buf
        # Each block's K (or V) is one contiguous chunk: select whole chunks as rows of a 2-D
        # strided view, which is much faster on the CPU than index_select over the 4-D view.
        chunk = buf[0].numel()
        assert source[0].is_contiguous()
        rows = torch.as_strided(source, (source.shape[0], chunk), (source.stride(0), 1))
        torch.index_select(rows, 0, block_ids, out=buf.view(-1, chunk))
        return buf


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


def _written(key: torch.Tensor, value: torch.Tensor, plan: _StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V rows of the step's tokens that have a slot."""
    if plan.write_rows is not None:
        return key[plan.write_rows], value[plan.write_rows]
    return key, value


def _slot_rows(kv_cache: torch.Tensor, plan: _StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's pool as rows of one strided view (one row a slot's K or V), and the rows the
    step's K and V go to: index_copy_ on it is far faster on the CPU than advanced-index
    assignment into the (non-contiguous) layer view."""
    block_stride, kv_stride, slot_stride = kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2)
    assert block_stride % slot_stride == 0 and kv_stride % slot_stride == 0
    num_rows = (kv_cache.shape[0] - 1) * (block_stride // slot_stride) + (kv_stride // slot_stride) + kv_cache.shape[2]
    rows = torch.as_strided(kv_cache, (num_rows, *kv_cache.shape[3:]), (slot_stride, *kv_cache.stride()[3:]))
    return (rows, *plan.write_index(block_stride // slot_stride, kv_stride // slot_stride))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @classmethod
    def prepare_metadata(cls, metadata: AttentionMetadata) -> None:
        metadata.extra[PLAN_KEY] = _StepPlan.build(metadata)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        plan = metadata.extra.get(PLAN_KEY)
        if plan is None:
            self.prepare_metadata(metadata)
            plan = metadata.extra[PLAN_KEY]
        self._write(key, value, kv_cache, plan)
        out = torch.zeros_like(query) if plan.padded else torch.empty_like(query)
        if plan.decode is not None:
            self._decode_into(out, query, kv_cache, plan)
        for i, seq in enumerate(plan.prefills):
            out[seq.start : seq.end] = self._prefill(query, key, value, kv_cache, plan, i)
        return out

    @classmethod
    def _write(cls, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        rows, k_rows, v_rows = _slot_rows(kv_cache, plan)
        key, value = _written(key, value, plan)
        rows.index_copy_(0, k_rows, key.to(kv_cache.dtype))
        rows.index_copy_(0, v_rows, value.to(kv_cache.dtype))

    def _decode_into(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> None:
        """Write the attention of the plan's one-query rows into their rows of ``out``."""
        out[plan.decode.rows] = self._decode(query, kv_cache, plan)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan) -> torch.Tensor:
        d = plan.decode
        num_seqs = d.rows.shape[0]
        groups = self.num_heads // self.num_kv_heads
        ctx = d.num_blocks * plan.block_size
        q = query.index_select(0, d.rows).view(num_seqs, self.num_kv_heads, groups, self.head_dim)
        k = plan.gather(kv_cache, 0, d.block_ids, ("decode",)).view(num_seqs, ctx, self.num_kv_heads, self.head_dim)
        v = plan.gather(kv_cache, 1, d.block_ids, ("decode",)).view(num_seqs, ctx, self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(
            q, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
            attn_mask=plan.decode_mask(self.sliding_window, q.dtype), scale=self.scale,
        )
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 plan: _StepPlan, index: int) -> torch.Tensor:
        seq = plan.prefills[index]
        q = query[seq.start : seq.end].transpose(0, 1)[None]
        if seq.context_len == 0:
            k, v = key[seq.start : seq.end], value[seq.start : seq.end]
        else:
            k = plan.gather(kv_cache, 0, seq.block_ids, ("prefill", index)).flatten(0, 1)[: seq.seq_len].to(q.dtype)
            v = plan.gather(kv_cache, 1, seq.block_ids, ("prefill", index)).flatten(0, 1)[: seq.seq_len].to(q.dtype)
        causal_only = seq.context_len == 0 and self.sliding_window is None
        gqa = self.num_heads != self.num_kv_heads
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        n = seq.end - seq.start
        piece = max(1, MAX_MASK_BYTES // (seq.seq_len * q.element_size()))
        if causal_only or piece >= n:
            mask = None if causal_only else plan.prefill_mask(index, self.sliding_window, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal_only, scale=self.scale,
                                                 enable_gqa=gqa)
            return out[0].transpose(0, 1)
        outs = []
        for a in range(0, n, piece):
            b = min(n, a + piece)
            keys = seq.context_len + b
            mask = plan.prefill_mask(index, self.sliding_window, q.dtype, (a, b))
            outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :keys], v[:, :, :keys], attn_mask=mask,
                                                       scale=self.scale, enable_gqa=gqa))
        return torch.cat(outs, dim=2)[0].transpose(0, 1)
