"""Structured outputs on the runner side: the engine's packed token bitmask (GrammarBitmask)
unpacked into the boolean masks the sampler applies.

The grammars themselves live in the engine process (tandem.structured_outputs); a worker only
reads, for each row it samples, the bits of that row's sequence::

    bitmask[i, w] (int32)   bit b (least significant first) allows token 32 * w + b
"""
from __future__ import annotations

import torch

from tandem.sched.output import GrammarBitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(grammar: GrammarBitmask, request_ids: list[str], vocab_size: int,
                   device: torch.device) -> list[torch.Tensor | None]:
    """For each of ``request_ids`` (the rows about to be sampled), a bool ``[vocab_size]`` mask
    of the tokens its grammar allows, or None when it has no grammar this step. Tokens past the
    bitmask's width (a vocabulary padded beyond the grammar's) are not allowed."""
    row_of = {rid: i for i, rid in enumerate(grammar.request_ids)}
    rows = [row_of.get(rid) for rid in request_ids]
    wanted = [r for r in rows if r is not None]
    if not wanted:
        return [None] * len(request_ids)
    bits = torch.from_numpy(grammar.bitmask[wanted]).to(device)
    unpacked = ((bits.unsqueeze(-1) >> _SHIFTS.to(device)) & 1).to(torch.bool).flatten(1)
    if unpacked.shape[1] < vocab_size:
        unpacked = torch.nn.functional.pad(unpacked, (0, vocab_size - unpacked.shape[1]))
    masks = iter(unpacked[:, :vocab_size])
    return [next(masks) if r is not None else None for r in rows]
