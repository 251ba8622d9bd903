"""The sampler: one step's logits in, one token per row out.

Contract: called on the engine's model device once per step over every row that samples. Each row
is sanitized (NaN excluded, a row with ``+inf`` keeps only those tokens), masked by its grammar,
processed by tandem.worker.logits_processing (allowed ids, bans, bias, penalties, temperature and
filters), then greedy rows take the argmax and the others an inverse-CDF draw (a seeded row uses
its own generator and its own row only, so batching does not change its tokens). Whatever the
logits and the admitted parameters, every row gets a token in ``[0, vocab)`` and every logprob is
finite (-inf is reported as float32's lowest value); a row left with nothing takes the model's own
greedy choice, within its grammar if it has one. Logprobs are the raw model distribution's, as
vLLM's default. Every rule, and why: docs/architecture.md §8.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.kernels import cpu_ops
from tandem.sched.output import TokenLogprobs
from tandem.worker.logits_processing import process_logits, select_rows
from tandem.worker.sampling_row import SamplingRow

_LOGPROB_CHUNK_ROWS = 512
_MASK64 = (1 << 64) - 1
_F32_LOWEST = torch.finfo(torch.float32).min  # reported for a logprob of -inf


@dataclass(slots=True)
class SamplerOutput:
    """Row ``i`` sampled ``token_ids[i]``; ``logprobs[i]`` is set when its params ask for logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def make_generator(seed: int, sample_index: int, device: torch.device | str) -> torch.Generator:
    """The generator of sequence ``sample_index`` of a request seeded with ``seed``.

    The same (seed, sample_index) always gives the same stream; the ``n`` sequences of one request
    get distinct streams. The pair is mixed with the splitmix64 finalizer so that nearby seeds and
    indices give unrelated streams.
    """
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + sample_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    generator = torch.Generator(device=device)
    generator.manual_seed(x ^ (x >> 31))
    return generator


class Sampler:
    """Samples one token per row. Stateless; called once per step by the model runner.

    ``cpu_kernels``: draw and take the greedy argmax of CPU float32 logits with tandem's CPU
    kernels (``tandem.kernels.cpu_ops.draw_rows`` and ``argmax_rows``: the same inverse-CDF draw
    in one pass for the max, one for exp and the sums, and a partial one for the search; the
    same first index of the largest logit) instead of torch's softmax, cumsum and searchsorted
    and its ``max``; the model runner asks for them when ``engine.cpu_kernels`` resolves to
    tandem's. Both draws take token k with probability softmax(logits)[k] from the same uniform
    number; they can differ only where that number falls within rounding of a boundary of the
    cumulative sums."""

    def __init__(self, cpu_kernels: bool = False) -> None:
        self.cpu_kernels = cpu_kernels and cpu_ops.load()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Samples a token for each row of ``logits`` ([len(rows), vocab], float32; another dtype
        is converted first). Whatever the logits and admitted params: every token lies in
        ``[0, vocab)`` and every logprob is finite (module docstring, "Safety").

        ``logits`` is consumed: it is modified in place.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(_is_plain_greedy(row) for row in rows):
            token_ids = _plain_argmax(logits, self.cpu_kernels)
            if token_ids is not None:
                return SamplerOutput(token_ids, [None] * len(rows))
        logits = logits.float()
        non_finite = sanitize_logits(logits)
        fallback = _fallback_tokens(logits, rows, non_finite)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = _finite_log_softmax(select_rows(logits, logprob_rows))
        for i, row in enumerate(rows):
            if row.allowed is not None:
                logits[i].masked_fill_(~row.allowed, float("-inf"))
        process_logits(logits, rows)
        token_ids = _sample(logits, rows, fallback, self.cpu_kernels)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            num_top = min(max(rows[i].params.logprobs for i in logprob_rows), logits.shape[1])
            entries = _logprob_entries(raw_logprobs, [token_ids[i] for i in logprob_rows], num_top)
            for i, entry in zip(logprob_rows, entries):
                k = rows[i].params.logprobs
                logprobs[i] = TokenLogprobs(entry.token_id, entry.logprob, entry.rank, entry.top[:k])
        return SamplerOutput(token_ids, logprobs)


def compute_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """Entry ``i``: logprob and rank of ``token_ids[i]`` under ``log_softmax(logits[i])``, plus the
    ``num_top`` most likely tokens sorted by descending logprob.

    Rank is 1-based over the whole vocabulary (1 + the number of tokens strictly more likely).
    Rows are processed in chunks, so prompt logprobs of a long prompt need little extra memory.
    Logits are sanitized and logprobs made finite as in the module docstring (float32 rows holding
    NaN or +inf are rewritten in place).
    """
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids), (logits.shape, len(token_ids))
    num_top = min(num_top, logits.shape[1])
    entries: list[TokenLogprobs] = []
    for start in range(0, len(token_ids), _LOGPROB_CHUNK_ROWS):
        end = start + _LOGPROB_CHUNK_ROWS
        chunk = logits[start:end].float()
        sanitize_logits(chunk)
        entries += _logprob_entries(_finite_log_softmax(chunk), token_ids[start:end], num_top)
    return entries


def sanitize_logits(logits: torch.Tensor) -> list[int]:
    """Rewrites, in place, the rows of ``logits`` that hold NaN or +inf (rule in the module
    docstring). Returns the rows that hold a logit other than a finite one (or whose sum
    overflows), in ascending order."""
    # A row's sum is finite only if every logit in it is: one cheap pass finds the rows to rewrite
    # (an argmax, which would spot them too, costs far more on a CPU).
    non_finite = (~logits.sum(dim=-1).isfinite()).nonzero().squeeze(1)
    if non_finite.numel():
        rows = logits[non_finite]
        rows.masked_fill_(rows.isnan(), -math.inf)
        certain = rows.isposinf()
        only_certain = torch.where(certain, 0.0, -math.inf)
        logits[non_finite] = torch.where(certain.any(dim=-1, keepdim=True), only_certain, rows)
    return non_finite.tolist()


def _fallback_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], non_finite: list[int]
) -> torch.Tensor:
    """Each row's fallback: the argmax of its sanitized raw logits, for the rows that can be left
    with no finite logit (a mask, min_tokens bans, a logit that is not finite); 0 for the others,
    which always keep one (see process_logits)."""
    fallback = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
    masked = {i for i, row in enumerate(rows) if row.may_exclude_all}
    row_ids = sorted(masked.union(non_finite))
    if row_ids:
        index = torch.tensor(row_ids, device=logits.device)
        fallback[index] = select_rows(logits, row_ids).argmax(dim=-1)
    lowest = torch.finfo(logits.dtype).min
    for i, row in enumerate(rows):
        if row.allowed is not None and row.allowed.any():
            fallback[i] = torch.where(row.allowed, logits[i].clamp(min=lowest), -math.inf).argmax()
    return fallback


def _plain_argmax(logits: torch.Tensor, cpu_kernel: bool = False) -> list[int] | None:
    """Each row's argmax, or None where a row holds a NaN (that row needs sanitizing first).
    ``cpu_kernel``: ``cpu_ops.argmax_rows`` for CPU float32 logits (see ``Sampler``)."""
    if cpu_kernel and logits.device.type == "cpu" and logits.dtype == torch.float32:
        tokens = torch.empty(logits.shape[0], dtype=torch.long)
        cpu_ops.argmax_rows(tokens, logits if logits.stride(-1) == 1 else logits.contiguous())
        token_ids = tokens.tolist()
        return None if -1 in token_ids else token_ids
    # max takes a row's first NaN over any number (the same index as argmax, at the same cost).
    chosen, argmax = logits.max(dim=-1)
    token_ids = argmax.masked_fill_(chosen.isnan(), -1).tolist()
    return None if -1 in token_ids else token_ids


def _finite_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    # A row with no finite logit has NaN logprobs: undefined, reported like -inf.
    return torch.log_softmax(logits, dim=-1).nan_to_num_(nan=_F32_LOWEST, neginf=_F32_LOWEST)


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and row.allowed is None
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not row.before_min_tokens
        and not p.constrains_tokens
    )


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow], fallback: torch.Tensor,
            cpu_kernel: bool = False) -> list[int]:
    """Row ``i``'s token, or ``fallback[i]`` where its processed logits are all -inf."""
    token_ids = fallback.clone()
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if greedy:
        _put_chosen(token_ids, greedy, _argmax(select_rows(logits, greedy)))
    if sampled:
        generators = [rows[i].generator for i in sampled]
        _put_chosen(token_ids, sampled, _draw(select_rows(logits, sampled), generators, cpu_kernel))
    return token_ids.tolist()


def _put_chosen(token_ids: torch.Tensor, row_ids: list[int], chosen: torch.Tensor) -> None:
    """``token_ids[row_ids[j]] = chosen[j]``, except where ``chosen[j]`` is -1 (nothing left)."""
    index = torch.tensor(row_ids, device=token_ids.device)
    token_ids[index] = torch.where(chosen >= 0, chosen, token_ids[index])


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; -1 for a row of -inf only."""
    chosen, argmax = logits.max(dim=-1)
    return argmax.masked_fill_(chosen == -math.inf, -1)


def _draw(logits: torch.Tensor, generators: list[torch.Generator | None], cpu_kernel: bool = False) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of ``softmax(logits)``; a token of probability 0 is
    never drawn (its cumulative value equals its predecessor's). -1 for a row of -inf only.
    One uniform number per row, from the row's generator, whichever way it is drawn (a seeded
    stream stays aligned): with ``cpu_kernel``, ``cpu_ops.draw_rows`` (see ``Sampler``) on CPU
    float32 logits, else torch.

    ``logits`` holds no NaN or +inf (see process_logits), so a row with a finite logit has a CDF
    of finite values whose total is at least 1 / vocab, and ``target < total`` keeps the search
    inside the row even where rounding makes the CDF not quite monotone."""
    u = _uniforms(generators, logits.device)
    if cpu_kernel and logits.device.type == "cpu" and logits.dtype == torch.float32:
        tokens = torch.empty(logits.shape[0], dtype=torch.long)
        cpu_ops.draw_rows(tokens, logits if logits.stride(-1) == 1 else logits.contiguous(), u.float())
        return tokens
    cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = u[:, None] * total
    # Rounding may lift u * total to total itself; the largest float below it is still in range.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # A row of -inf only has a NaN CDF (softmax of it is NaN): its search means nothing.
    return drawn.masked_fill_(~(total[:, 0] > 0), -1)


def _uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row, from the row's own generator when it has one."""
    u = torch.empty(len(generators), device=device)
    unseeded = [j for j, generator in enumerate(generators) if generator is None]
    if unseeded:
        u[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), device=device)
    for j, generator in enumerate(generators):
        if generator is not None:
            u[j : j + 1] = torch.rand(1, generator=generator, device=device)
    return u


def _logprob_entries(
    logprobs: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    chosen_ids = torch.tensor(list(token_ids), device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, chosen_ids)
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(num_top, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(
            token_id=int(token_id),
            logprob=value,
            rank=rank,
            top=tuple(zip(ids, values, range(1, num_top + 1))),
        )
        for token_id, value, rank, ids, values in zip(
            token_ids, chosen[:, 0].tolist(), ranks, top_ids, top_values
        )
    ]
