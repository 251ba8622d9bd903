"""The model runner's per-request state and the flattening of one step into model inputs.

The runner receives diffs (tandem.sched.output) and keeps, per request, the token ids it knows and
its block table. Building a step's inputs turns the scheduled requests into one flattened batch
without padding::

    request A: 5 prompt tokens (no prefix)      → rows 0..4,  positions 0..4
    request B: decode, 37 tokens computed       → row 5,      position 37
    request C: chunk 16..31 of a long prompt    → rows 6..21, positions 16..31

Token t of a request at position p is written to slot ``block_ids[p // bs] * bs + p % bs``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.interfaces import AttentionMetadata
from tandem.models.rotary import PROMPT_LENS_KEY
from tandem.sched.output import NewRequestData, SchedulerOutput
from tandem.sampling_params import SamplingParams


@dataclass(slots=True)
class RunnerRequest:
    """What the runner remembers of one running request between steps."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    sample_index: int
    block_ids: list[int]
    generator: torch.Generator | None = None

    @classmethod
    def from_new(cls, data: NewRequestData) -> RunnerRequest:
        return cls(
            request_id=data.request_id,
            token_ids=list(data.token_ids),
            num_prompt_tokens=data.num_prompt_tokens,
            params=data.sampling_params,
            sample_index=data.sample_index,
            block_ids=list(data.block_ids),
        )

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass(slots=True)
class StepInputs:
    """One step's flattened inputs. ``sample_rows[i]`` is the row of ``hidden`` whose logits
    request ``sample_request_ids[i]`` samples from; ``prompt_rows[rid]`` are the rows whose
    logits give prompt logprobs (positions ``prompt_positions[rid]``)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_request_ids: list[str] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    prompt_rows: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    spec_rows: dict[str, int] = field(default_factory=dict)
    """Requests checking drafts: the row of their last known token; rows ``row .. row + k``
    give the model's token after it and after each of the ``k`` drafts."""


def build_step_inputs(
    requests: dict[str, RunnerRequest],
    out: SchedulerOutput,
    starts: dict[str, int],
    block_size: int,
    device: torch.device,
) -> StepInputs:
    """Flatten the requests scheduled in ``out``; ``starts[rid]`` is the position of the first
    token each computes this step (its num_computed_tokens before the step)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    sample_ids: list[str] = []
    sample_rows: list[int] = []
    prompt_rows: dict[str, tuple[int, int, int]] = {}
    spec_rows: dict[str, int] = {}
    prompt_lens: list[int] = []
    for rid, n in out.num_scheduled_tokens.items():
        req = requests[rid]
        prompt_lens.append(req.num_prompt_tokens)
        start, end = starts[rid], starts[rid] + n
        row0 = len(ids)
        ids.extend(req.token_ids[start:end])
        drafts = out.spec_token_ids.get(rid)
        if drafts:
            assert start == len(req.token_ids) - 1 and n == 1 + len(drafts), (rid, start, n)
            ids.extend(drafts)
            spec_rows[rid] = row0
        positions.extend(range(start, end))
        table = req.block_ids
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start.append(len(ids))
        seq_lens.append(end)
        context_lens.append(start)
        tables.append(table)
        if end == len(req.token_ids) and not drafts:
            sample_ids.append(rid)
            sample_rows.append(len(ids) - 1)
        if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens:
            last = min(end, req.num_prompt_tokens - 1)
            prompt_rows[rid] = (row0, start, last)
    # two conversions from Python lists (int64: ids, positions, slots; int32: offsets, lengths,
    # padded tables), each sliced into views: one copy to the device, not seven
    num_tokens, num_seqs = len(ids), len(tables)
    width = max(max((len(t) for t in tables), default=0), 1)
    longs = torch.tensor(ids + positions + slots, dtype=torch.long, device=device)
    flat_ints = query_start + seq_lens + context_lens
    for t in tables:
        flat_ints.extend(t)
        if len(t) < width:
            flat_ints.extend([0] * (width - len(t)))
    ints = torch.tensor(flat_ints, dtype=torch.int32, device=device)
    i0, i1 = num_seqs + 1, 2 * num_seqs + 1
    query_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    metadata = AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=longs[2 * num_tokens:],
        query_start_loc=ints[:i0],
        seq_lens=ints[i0:i1],
        context_lens=ints[i1:i1 + num_seqs],
        block_tables=ints[i1 + num_seqs:].view(num_seqs, width),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        extra={PROMPT_LENS_KEY: prompt_lens},
    )
    return StepInputs(
        input_ids=longs[:num_tokens],
        positions=longs[num_tokens:2 * num_tokens],
        metadata=metadata,
        sample_request_ids=sample_ids,
        sample_rows=sample_rows,
        prompt_rows=prompt_rows,
        spec_rows=spec_rows,
    )


def split_microbatches(out: SchedulerOutput, count: int) -> list[SchedulerOutput]:
    """Cut the scheduled requests of ``out`` into at most ``count`` contiguous groups of about
    equal tokens, in schedule order (pipeline parallelism's micro-batches). Each part carries
    its requests' scheduled tokens, drafts and the children forked from them; the state
    updates (new, cached, finished requests, block copies) stay with ``out``."""
    items = list(out.num_scheduled_tokens.items())
    count = max(1, min(count, len(items)))
    bounds, acc, parts = [], 0, []
    for i, (_, n) in enumerate(items):
        acc += n
        if len(bounds) < count - 1 and acc * count >= out.total_num_scheduled_tokens * (len(bounds) + 1) \
                and len(items) - i - 1 >= count - 1 - len(bounds):
            bounds.append(i + 1)
    for lo, hi in zip([0] + bounds, bounds + [len(items)]):
        chosen = dict(items[lo:hi])
        parts.append(SchedulerOutput(
            num_scheduled_tokens=chosen,
            total_num_scheduled_tokens=sum(chosen.values()),
            spec_token_ids={rid: d for rid, d in out.spec_token_ids.items() if rid in chosen},
            forked_requests=[f for f in out.forked_requests if f.parent_id in chosen],
        ))
    return [p for p in parts if p.num_scheduled_tokens]
