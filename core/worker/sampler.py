"""The sampler: one step's logits in, one token per row out.

Runs in the engine thread on the model's device, once per step, over every row that samples this
step. Per row, in this order:

1. ``min_tokens``: while fewer outputs than that exist, EOS ids (unless ``ignore_eos``) and
   ``stop_token_ids`` get logit -inf;
2. repetition penalty over prompt + output tokens (HF semantics: a positive logit is divided by the
   penalty, a negative one multiplied);
3. presence and frequency penalties over output tokens only (OpenAI semantics:
   ``logit -= presence * (count > 0) + frequency * count``);
4. greedy rows (``temperature == 0``) take the argmax; the others are divided by the temperature,
   filtered by top-k, top-p and min-p (filtered logits become -inf), and drawn from.

Logprobs describe the RAW model distribution (``log_softmax`` of the logits before any of the above).

Randomness. A draw is inverse-CDF sampling: one uniform number ``u`` per row, the token is the first
whose cumulative probability exceeds ``u`` times the row's total. A seeded row takes its ``u`` from
its own generator and its CDF from its own row only, so its tokens do not depend on what else shares
the batch; unseeded rows share the device's default generator.

Cost. Every pass is vectorized over the rows that need it (a row needing no penalty costs nothing
there); a batch of plain greedy rows is a single argmax. Top-p looks for the nucleus among the
``_TOP_P_CANDIDATES`` most likely tokens, and only for the rows whose nucleus is larger among
``_TOP_P_GROWTH`` times as many, and so on (a full sort of 64 x 32000 costs ~20x a top-256).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from tandem.sched.output import TokenLogprobs
from tandem.sched.sampling_params import SamplingParams

_TOP_P_CANDIDATES = 256
_TOP_P_GROWTH = 8
_LOGPROB_CHUNK_ROWS = 512
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample, with what its processing needs to know about its request."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    allowed: torch.Tensor | None = None  # JSON mode: bool [vocab], the tokens that may come


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
    """Samples one token per row. Stateless; called once per step by the model runner."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Samples a token for each row of ``logits`` ([len(rows), vocab], float32).

        ``logits`` is consumed: it is modified in place.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(_is_plain_greedy(row) for row in rows):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = torch.log_softmax(_select_rows(logits, logprob_rows), dim=-1)
        for i, row in enumerate(rows):
            if row.allowed is not None:
                logits[i].masked_fill_(~row.allowed, float("-inf"))
        process_logits(logits, rows)
        token_ids = _sample(logits, rows)
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            num_top = max(rows[i].params.logprobs for i in logprob_rows)
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
    """
    assert logits.dim() == 2 and logits.shape[0] == len(token_ids), (logits.shape, len(token_ids))
    entries: list[TokenLogprobs] = []
    for start in range(0, len(token_ids), _LOGPROB_CHUNK_ROWS):
        end = start + _LOGPROB_CHUNK_ROWS
        logprobs = torch.log_softmax(logits[start:end].float(), dim=-1)
        entries += _logprob_entries(logprobs, token_ids[start:end], num_top)
    return entries


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Applies, in place, steps 1–4 of the module docstring up to the draw.

    Greedy rows get the bans and penalties only (temperature and the filters cannot change their
    argmax). Filtered tokens of the other rows are -inf, so ``softmax`` of a row is the
    distribution it is drawn from.
    """
    _ban_before_min_tokens(logits, rows)
    _apply_repetition_penalty(logits, rows)
    _apply_presence_frequency_penalties(logits, rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    _apply_temperature(logits, rows, sampled)
    _apply_top_k(logits, rows, sampled)
    _apply_top_p(logits, rows, sampled)
    _apply_min_p(logits, rows, sampled)


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.greedy
        and row.allowed is None
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and len(row.output_token_ids) >= p.min_tokens
    )


def _select_rows(logits: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """The rows ``row_ids`` (ascending): a view when they are contiguous, else a copy."""
    if _is_contiguous(row_ids):
        return logits[row_ids[0] : row_ids[-1] + 1]
    return logits.index_select(0, torch.tensor(row_ids, device=logits.device))


def _is_contiguous(row_ids: list[int]) -> bool:
    return row_ids[-1] - row_ids[0] + 1 == len(row_ids)


def _on_rows(
    logits: torch.Tensor, row_ids: list[int], modify: Callable[[torch.Tensor], None]
) -> None:
    """Calls ``modify`` (which works in place) on the rows ``row_ids`` (ascending) of ``logits``."""
    if not row_ids:
        return
    rows = _select_rows(logits, row_ids)
    modify(rows)
    if not _is_contiguous(row_ids):
        logits.index_copy_(0, torch.tensor(row_ids, device=logits.device), rows)


def _ban_before_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_idx: list[int] = []
    token_idx: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) if p.ignore_eos else row.eos_token_ids.union(p.stop_token_ids)
        row_idx += [i] * len(banned)
        token_idx += banned
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits[index] = -math.inf


def _flat_token_index(
    logits: torch.Tensor, row_ids: list[int], token_lists: list[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of ``token_lists[j]`` for row ``row_ids[j]``."""
    device = logits.device
    lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
    row_idx = torch.tensor(row_ids, device=device).repeat_interleave(lengths)
    token_idx = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    return row_idx, token_idx


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if not row_ids:
        return
    token_lists = [list(chain(rows[i].prompt_token_ids, rows[i].output_token_ids)) for i in row_ids]
    row_idx, token_idx = _flat_token_index(logits, row_ids, token_lists)
    penalty = _param_values(rows, range(len(rows)), "repetition_penalty", logits)[row_idx]
    # A token seen twice is gathered twice; both copies compute the same value from the original
    # logit, so the scatter below writes it once in effect.
    seen = logits[row_idx, token_idx]
    logits[row_idx, token_idx] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _apply_presence_frequency_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_ids = [
        i
        for i, row in enumerate(rows)
        if (row.params.presence_penalty or row.params.frequency_penalty) and row.output_token_ids
    ]
    if not row_ids:
        return
    vocab_size = logits.shape[1]
    outputs = [rows[i].output_token_ids for i in row_ids]
    row_idx, token_idx = _flat_token_index(logits, row_ids, outputs)
    keys, counts = torch.unique(row_idx * vocab_size + token_idx, return_counts=True)
    row_idx, token_idx = keys // vocab_size, keys % vocab_size
    all_rows = range(len(rows))
    presence = _param_values(rows, all_rows, "presence_penalty", logits)[row_idx]
    frequency = _param_values(rows, all_rows, "frequency_penalty", logits)[row_idx]
    logits.index_put_(
        (row_idx, token_idx), -(presence + frequency * counts.to(logits.dtype)), accumulate=True
    )


def _param_values(
    rows: Sequence[SamplingRow], row_ids: Sequence[int], field: str, like: torch.Tensor
) -> torch.Tensor:
    """``params.<field>`` of the rows ``row_ids``, as a vector of ``like``'s dtype and device."""
    values = [getattr(rows[i].params, field) for i in row_ids]
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _apply_temperature(logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int]) -> None:
    row_ids = [i for i in sampled if rows[i].params.temperature != 1.0]
    if row_ids:
        temperature = _param_values(rows, row_ids, "temperature", logits)[:, None]
        _on_rows(logits, row_ids, lambda sub: sub.div_(temperature))


def _apply_top_k(logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int]) -> None:
    vocab_size = logits.shape[1]
    row_ids = [i for i in sampled if 0 < rows[i].params.top_k < vocab_size]
    if not row_ids:
        return
    ks = [rows[i].params.top_k for i in row_ids]
    top_k = torch.tensor(ks, device=logits.device)

    def keep_top_k(sub: torch.Tensor) -> None:
        # Ties with the k-th logit are kept, like HF's TopKLogitsWarper.
        top = sub.topk(max(ks), dim=-1).values
        kth = top.gather(1, (top_k - 1)[:, None])
        sub.masked_fill_(sub < kth, -math.inf)

    _on_rows(logits, row_ids, keep_top_k)


def _apply_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int]) -> None:
    row_ids = [i for i in sampled if rows[i].params.top_p < 1.0]
    if not row_ids:
        return
    top_p = _param_values(rows, row_ids, "top_p", logits)[:, None]
    vocab_size = logits.shape[1]

    def keep_nucleus(sub: torch.Tensor) -> None:
        probs = sub.softmax(dim=-1)
        num_candidates = min(_TOP_P_CANDIDATES, vocab_size)
        remove, covered = _outside_nucleus(probs, top_p, num_candidates)
        while not bool(covered.all()):
            num_candidates = min(num_candidates * _TOP_P_GROWTH, vocab_size)
            wide = (~covered).nonzero().squeeze(1)
            remove[wide], covered[wide] = _outside_nucleus(probs[wide], top_p[wide], num_candidates)
            if num_candidates == vocab_size:
                break
        sub.masked_fill_(remove, -math.inf)

    _on_rows(logits, row_ids, keep_nucleus)


def _outside_nucleus(
    probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens lie outside each row's nucleus, looking only at its ``num_candidates`` most
    likely tokens.

    The nucleus: the most likely tokens, in order, while the mass of the tokens before them is below
    ``top_p`` (so it always holds the top token). Returns (remove [rows, vocab], covered [rows]);
    a row's mask is right only where ``covered`` (its candidates' mass reaches ``top_p``).
    """
    top_probs, top_ids = probs.topk(num_candidates, dim=-1)
    mass_before = top_probs.cumsum(dim=-1) - top_probs
    remove = torch.ones_like(probs, dtype=torch.bool)
    remove.scatter_(1, top_ids, mass_before >= top_p)
    covered = mass_before[:, -1] + top_probs[:, -1] >= top_p[:, 0]
    return remove, covered


def _apply_min_p(logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int]) -> None:
    row_ids = [i for i in sampled if rows[i].params.min_p > 0.0]
    if not row_ids:
        return
    log_min_p = _param_values(rows, row_ids, "min_p", logits)[:, None].log()

    def keep_likely(sub: torch.Tensor) -> None:
        # prob < min_p * top_prob  <=>  logit < top_logit + log(min_p)
        sub.masked_fill_(sub < sub.amax(dim=-1, keepdim=True) + log_min_p, -math.inf)

    _on_rows(logits, row_ids, keep_likely)


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    token_ids = [0] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if greedy:
        for i, token in zip(greedy, _select_rows(logits, greedy).argmax(dim=-1).tolist()):
            token_ids[i] = token
    if sampled:
        generators = [rows[i].generator for i in sampled]
        for i, token in zip(sampled, _draw(_select_rows(logits, sampled), generators).tolist()):
            token_ids[i] = token
    return token_ids


def _draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of ``softmax(logits)``; a token of probability 0 is
    never drawn (its cumulative value equals its predecessor's)."""
    cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = _uniforms(generators, logits.device)[:, None] * total
    # Rounding may lift u * total to total itself; the largest float below it is still in range.
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


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
