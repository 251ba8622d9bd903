"""Build ``AttentionMetadata`` for hand-made paged batches, written plainly from the contract in
``tandem.interfaces.AttentionMetadata`` (independent of the model runner).

    seqs = [SeqSpec(block_table=[7, 3], context_len=16, query_len=4), SeqSpec([5], 0, 9)]
    md = build_metadata(seqs, block_size=16)           # rows 0..3 → seq 0, rows 4..12 → seq 1
    positions = positions_of(seqs)                      # [16, 17, 18, 19, 0, 1, ..., 8]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.interfaces import AttentionMetadata


@dataclass
class SeqSpec:
    """One sequence of a step: its block table, tokens already cached, tokens computed now."""

    block_table: list[int]
    context_len: int
    query_len: int

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def positions_of(seqs: list[SeqSpec], num_padding_tokens: int = 0) -> torch.Tensor:
    pos = [p for s in seqs for p in range(s.context_len, s.seq_len)]
    return torch.tensor(pos + [0] * num_padding_tokens, dtype=torch.long)


def build_metadata(seqs: list[SeqSpec], block_size: int, *, num_padding_tokens: int = 0,
                   device: str | torch.device = "cpu") -> AttentionMetadata:
    """Metadata for ``seqs`` flattened in order, plus ``num_padding_tokens`` trailing rows that
    belong to no sequence (slot -1). Block tables are padded with 0 to the longest."""
    slots = [slot_of(s.block_table, p, block_size) for s in seqs for p in range(s.context_len, s.seq_len)]
    slots += [-1] * num_padding_tokens
    query_start = [0]
    for s in seqs:
        query_start.append(query_start[-1] + s.query_len)
    width = max(len(s.block_table) for s in seqs)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
    dev = torch.device(device)
    return AttentionMetadata(
        num_tokens=len(slots),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([s.seq_len for s in seqs], dtype=torch.int32, device=dev),
        context_lens=torch.tensor([s.context_len for s in seqs], dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        max_query_len=max(s.query_len for s in seqs),
        max_seq_len=max(s.seq_len for s in seqs),
        block_size=block_size,
        query_lens_cpu=[s.query_len for s in seqs],
        seq_lens_cpu=[s.seq_len for s in seqs],
    )


def scattered_tables(lengths: list[int], block_size: int, num_blocks: int, seed: int = 0) -> list[list[int]]:
    """Disjoint block tables for sequences of ``lengths`` tokens, blocks drawn in random order
    from 1..num_blocks-1 (block 0 stays the null block)."""
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in lengths:
        k = -(-n // block_size)
        tables.append(free[:k])
        free = free[k:]
    return tables
