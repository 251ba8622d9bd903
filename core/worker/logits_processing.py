"""Logits processing: the bans, penalties, temperature and filters each row gets before its draw.

Per row, in this order (``process_logits``; greedy rows get steps 1-5 only), as vLLM's sampler:

1. ``allowed_token_ids``: every other token gets logit -inf;
2. bans: the last token of each bad word whose other tokens end the outputs (``bad_word_bans``),
   and while fewer outputs than ``min_tokens`` exist, EOS ids (unless ``ignore_eos``) and
   ``stop_token_ids`` get logit -inf;
3. ``logit_bias`` is added to its tokens' logits;
4. repetition penalty over prompt + output tokens (HF semantics: a positive logit is divided by the
   penalty, a negative one multiplied), then presence and frequency penalties over output tokens
   only (OpenAI semantics: ``logit -= presence * (count > 0) + frequency * count``);
5. the rows that sample are divided by the temperature and filtered by top-k, top-p and min-p
   (filtered logits become -inf).

Safe for every admitted value: given logits without NaN or +inf (the sampler sanitizes them), no
step makes one, -inf stays -inf, overflowing arithmetic saturates at float32's finite bounds, and a
row with a finite logit after steps 1-2 keeps one (each value's rule: docs/architecture.md §8).

Cost: each pass runs only over the rows that need it; top-p searches the ``_TOP_P_CANDIDATES``
most likely tokens first, growing by ``_TOP_P_GROWTH`` only for rows whose nucleus is larger (a
full sort of the vocabulary costs far more).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import chain
import torch

from tandem.worker.sampling_row import SamplingRow

_TOP_P_CANDIDATES = 256
_TOP_P_GROWTH = 8
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Applies, in place, steps 1–5 of the module docstring.

    Greedy rows get steps 1-4 only (temperature and the filters cannot change their argmax). Filtered tokens of the other rows are -inf, so ``softmax`` of a row is the
    distribution it is drawn from. Given logits without NaN or +inf
    (tandem.worker.sampler.sanitize_logits), no step makes one, and a row that has a finite logit
    after the bans keeps one through every step.
    """
    _keep_allowed_token_ids(logits, rows)
    _ban_tokens(logits, rows)
    _apply_logit_bias(logits, rows)
    _apply_repetition_penalty(logits, rows)
    _apply_presence_frequency_penalties(logits, rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    _apply_temperature(logits, rows, sampled)
    _apply_top_k(logits, rows, sampled)
    _apply_top_p(logits, rows, sampled)
    _apply_min_p(logits, rows, sampled)


def select_rows(logits: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
    """The rows ``row_ids`` of ``logits`` (any tensor), in that order: a view when they are
    consecutive and ascending, else a copy (``index_select``; torch's indexing by a list would
    build the index on every call and share a few rows out to OpenMP's threads)."""
    if _is_contiguous(row_ids):
        return logits[row_ids[0] : row_ids[-1] + 1]
    return logits.index_select(0, torch.tensor(row_ids, device=logits.device))


def _is_contiguous(row_ids: list[int]) -> bool:
    first = row_ids[0]
    return row_ids[-1] - first + 1 == len(row_ids) and row_ids == list(range(first, first + len(row_ids)))


def _on_rows(
    logits: torch.Tensor, row_ids: list[int], modify: Callable[[torch.Tensor], None]
) -> None:
    """Calls ``modify`` (which works in place) on the rows ``row_ids`` (ascending) of ``logits``."""
    if not row_ids:
        return
    rows = select_rows(logits, row_ids)
    modify(rows)
    if not _is_contiguous(row_ids):
        logits.index_copy_(0, torch.tensor(row_ids, device=logits.device), rows)


def bad_word_bans(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word now: the last token of each sequence whose
    other tokens are the last outputs (a one-token word is always banned)."""
    num_outputs = len(output_token_ids)
    bans = []
    for ids in bad_words_token_ids:
        num_prefix = len(ids) - 1
        if num_prefix == 0 or (num_prefix <= num_outputs
                               and list(output_token_ids[num_outputs - num_prefix:]) == list(ids[:-1])):
            bans.append(ids[-1])
    return bans


def _keep_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        allowed = row.params.allowed_token_ids
        if allowed is None:
            continue
        ids = torch.tensor(allowed, dtype=torch.long, device=logits.device)
        ids = ids[ids < logits.shape[1]]
        kept = logits[i, ids]
        logits[i].fill_(-math.inf)
        logits[i, ids] = kept


def _ban_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_idx: list[int] = []
    token_idx: list[int] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        banned = set(bad_word_bans(p.bad_words_token_ids or (), row.output_token_ids))
        if row.before_min_tokens:
            banned |= set(p.stop_token_ids) if p.ignore_eos else row.eos_token_ids.union(p.stop_token_ids)
        banned = {t for t in banned if 0 <= t < vocab_size}  # an id outside it can never come
        row_idx += [i] * len(banned)
        token_idx += banned
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits[index] = -math.inf


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_idx: list[int] = []
    token_idx: list[int] = []
    biases: list[float] = []
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        for token_id, bias in (row.params.logit_bias or {}).items():
            if token_id < vocab_size:
                row_idx.append(i)
                token_idx.append(token_id)
                biases.append(bias)
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


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
    # In float64, where no admitted penalty is 0 or inf (5e-324 and 1e308 are not float32s).
    penalty = _param_values(rows, range(len(rows)), "repetition_penalty", logits, torch.float64)
    penalty = penalty[row_idx]
    # A token seen twice is gathered twice; both copies compute the same value from the original
    # logit, so the scatter below writes it once in effect.
    seen = logits[row_idx, token_idx].double()
    penalized = torch.where(seen < 0, seen * penalty, seen / penalty).clamp_(-_F32_MAX, _F32_MAX)
    # Saturated: a finite logit stays finite; an excluded one (-inf) stays excluded.
    logits[row_idx, token_idx] = torch.where(seen.isfinite(), penalized, seen).float()


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
    rows: Sequence[SamplingRow],
    row_ids: Sequence[int],
    field: str,
    like: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``params.<field>`` of the rows ``row_ids``, as a vector on ``like``'s device, of ``dtype``
    (default: ``like``'s; a value beyond float32's range becomes 0 or inf there)."""
    values = [getattr(rows[i].params, field) for i in row_ids]
    return torch.tensor(values, dtype=dtype or like.dtype, device=like.device)


def _apply_temperature(logits: torch.Tensor, rows: Sequence[SamplingRow], sampled: list[int]) -> None:
    row_ids = [i for i in sampled if rows[i].params.temperature != 1.0]
    if not row_ids:
        return
    temperature = _param_values(rows, row_ids, "temperature", logits)
    temperature = temperature.clamp_(_F32_TINY, _F32_MAX)[:, None]

    def divide(sub: torch.Tensor) -> None:
        top = sub.amax(dim=-1, keepdim=True)
        # Where top / temperature passes half of float32's max, a token below top is at least
        # ~5e30 below it once divided: probability exactly 0. Keep the ties with top, as equals.
        saturated = top.isfinite() & (top.abs() > temperature * (_F32_MAX / 2))
        if not bool(saturated.any()):
            sub.div_(temperature)
            return
        ties = torch.where(sub == top, 0.0, -math.inf)
        sub.copy_(torch.where(saturated, ties, sub / temperature))

    _on_rows(logits, row_ids, divide)


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
    # At least float32's smallest normal: a top_p of 0 would drop even the most likely token.
    top_p = _param_values(rows, row_ids, "top_p", logits).clamp_(min=_F32_TINY)[:, None]
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
    # log in float64: a min_p below float32's range has a finite log all the same.
    log_min_p = [math.log(rows[i].params.min_p) for i in row_ids]
    log_min_p = torch.tensor(log_min_p, dtype=logits.dtype, device=logits.device)[:, None]

    def keep_likely(sub: torch.Tensor) -> None:
        # prob < min_p * top_prob  <=>  logit < top_logit + log(min_p)
        sub.masked_fill_(sub < sub.amax(dim=-1, keepdim=True) + log_min_p, -math.inf)

    _on_rows(logits, row_ids, keep_likely)
