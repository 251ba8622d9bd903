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

Safety. Whatever the logits (``+inf``, ``-inf`` and NaN included) and whatever the admitted
parameters (penalties down to 5e-324 or up to 1e308, temperatures from 1e-300 to 1e300, ``top_p``
near 0, ``top_k`` beyond the vocabulary, ``min_p == 1``, masks and bans that exclude everything),
every row gets a token in ``[0, vocab)`` and every logprob is a finite float:

- Sanitizing. A NaN logit is -inf (its token is excluded). A row holding ``+inf`` keeps only those
  tokens, as equals: they become 0, every other token -inf (the limit of the distribution).
- No step makes a NaN or a ``+inf``; -inf (excluded) stays -inf through every step, and arithmetic
  that overflows float32 saturates. The repetition penalty is computed in float64 and a finite
  logit stays within float32's finite range (a seen logit of 1.0 under a penalty of 5e-324 becomes
  float32's max, one of -2.0 under 1e308 its negative). A temperature outside float32's range acts
  as its bound (smallest normal, largest finite); where a row's largest logit divided by the
  temperature overflows, the row keeps only the tokens tied with its largest logit, as equals (in
  float32 every other token's probability is exactly 0 there: the temperature is effectively
  greedy). ``top_p`` below float32's smallest normal acts as it (the nucleus is the single most
  likely token); ``log(min_p)`` is taken in float64; a ban of an id outside the vocabulary does
  nothing.
- Fallback. A row left with no finite logit (its JSON mask or its ``min_tokens`` bans exclude every
  token with a finite logit, or the model gave none) takes the argmax of its sanitized raw logits,
  the model's own greedy choice ignoring bans, mask and penalties; token 0 where those are all -inf
  too. It still consumes its uniform number, so a seeded stream stays aligned.
- Logprobs are those of the sanitized raw logits. A logprob of -inf, and every logprob of a row
  with no finite logit (whose distribution is undefined), is reported as float32's lowest value
  ``-3.4028234663852886e38``: JSON cannot carry infinity, and it sorts below every real logprob.

Randomness. A draw is inverse-CDF sampling: one uniform number ``u`` per row, the token is the first
whose cumulative probability exceeds ``u`` times the row's total. A seeded row takes its ``u`` from
its own generator and its CDF from its own row only, so its tokens do not depend on what else shares
the batch; unseeded rows share the device's default generator.

Cost. Every pass is vectorized over the rows that need it (a row needing no penalty costs nothing
there); a batch of plain greedy rows is a single argmax, plus a look at the values it chose (torch's
argmax takes a NaN over any number, so a NaN there sends the batch through sanitizing). Top-p looks
for the nucleus among the ``_TOP_P_CANDIDATES`` most likely tokens, and only for the rows whose
nucleus is larger among ``_TOP_P_GROWTH`` times as many, and so on (a full sort of 64 x 32000
costs ~20x a top-256).
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
_F32_MAX = torch.finfo(torch.float32).max
_F32_LOWEST = torch.finfo(torch.float32).min  # reported for a logprob of -inf
_F32_TINY = torch.finfo(torch.float32).tiny  # smallest normal float32


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
        """Samples a token for each row of ``logits`` ([len(rows), vocab], float32; another dtype
        is converted first). Whatever the logits and admitted params: every token lies in
        ``[0, vocab)`` and every logprob is finite (module docstring, "Safety").

        ``logits`` is consumed: it is modified in place.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        if all(_is_plain_greedy(row) for row in rows):
            token_ids = _plain_argmax(logits)
            if token_ids is not None:
                return SamplerOutput(token_ids, [None] * len(rows))
        logits = logits.float()
        non_finite = sanitize_logits(logits)
        fallback = _fallback_tokens(logits, rows, non_finite)
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = None
        if logprob_rows:
            raw_logprobs = _finite_log_softmax(_select_rows(logits, logprob_rows))
        for i, row in enumerate(rows):
            if row.allowed is not None:
                logits[i].masked_fill_(~row.allowed, float("-inf"))
        process_logits(logits, rows)
        token_ids = _sample(logits, rows, fallback)
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


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Applies, in place, steps 1–4 of the module docstring up to the draw.

    Greedy rows get the bans and penalties only (temperature and the filters cannot change their
    argmax). Filtered tokens of the other rows are -inf, so ``softmax`` of a row is the
    distribution it is drawn from. Given logits without NaN or +inf (``sanitize_logits``), no step
    makes one, and a row that has a finite logit after the bans keeps one through every step.
    """
    _ban_before_min_tokens(logits, rows)
    _apply_repetition_penalty(logits, rows)
    _apply_presence_frequency_penalties(logits, rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    _apply_temperature(logits, rows, sampled)
    _apply_top_k(logits, rows, sampled)
    _apply_top_p(logits, rows, sampled)
    _apply_min_p(logits, rows, sampled)


def sanitize_logits(logits: torch.Tensor) -> list[int]:
    """Rewrites, in place, the rows of ``logits`` that hold NaN or +inf (rule in the module
    docstring). Returns the rows that hold a logit other than a finite one (or whose sum
    overflows), in ascending order."""
    # A row's sum is finite only if every logit in it is: one cheap pass finds the rows to rewrite
    # (an argmax, which would spot them too, costs 10x as much on a CPU).
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
    constrained = {i for i, row in enumerate(rows) if row.allowed is not None or _bans_apply(row)}
    row_ids = sorted(constrained.union(non_finite))
    if row_ids:
        index = torch.tensor(row_ids, device=logits.device)
        fallback[index] = _select_rows(logits, row_ids).argmax(dim=-1)
    return fallback


def _plain_argmax(logits: torch.Tensor) -> list[int] | None:
    """Each row's argmax, or None where a row holds a NaN (that row needs sanitizing first)."""
    argmax = logits.argmax(dim=-1)
    chosen = logits.gather(1, argmax[:, None]).squeeze(1)
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
        and not _bans_apply(row)
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
    vocab_size = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not _bans_apply(row):
            continue
        banned = set(p.stop_token_ids) if p.ignore_eos else row.eos_token_ids.union(p.stop_token_ids)
        banned = {t for t in banned if 0 <= t < vocab_size}  # an id outside it can never come
        row_idx += [i] * len(banned)
        token_idx += banned
    if row_idx:
        device = logits.device
        index = (torch.tensor(row_idx, device=device), torch.tensor(token_idx, device=device))
        logits[index] = -math.inf


def _bans_apply(row: SamplingRow) -> bool:
    return len(row.output_token_ids) < row.params.min_tokens


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


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow], fallback: torch.Tensor) -> list[int]:
    """Row ``i``'s token, or ``fallback[i]`` where its processed logits are all -inf."""
    token_ids = fallback.clone()
    greedy = [i for i, row in enumerate(rows) if row.params.greedy]
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if greedy:
        _put_chosen(token_ids, greedy, _argmax(_select_rows(logits, greedy)))
    if sampled:
        generators = [rows[i].generator for i in sampled]
        _put_chosen(token_ids, sampled, _draw(_select_rows(logits, sampled), generators))
    return token_ids.tolist()


def _put_chosen(token_ids: torch.Tensor, row_ids: list[int], chosen: torch.Tensor) -> None:
    """``token_ids[row_ids[j]] = chosen[j]``, except where ``chosen[j]`` is -1 (nothing left)."""
    index = torch.tensor(row_ids, device=token_ids.device)
    token_ids[index] = torch.where(chosen >= 0, chosen, token_ids[index])


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax; -1 for a row of -inf only."""
    argmax = logits.argmax(dim=-1)
    chosen = logits.gather(1, argmax[:, None]).squeeze(1)
    return argmax.masked_fill_(chosen == -math.inf, -1)


def _draw(logits: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of ``softmax(logits)``; a token of probability 0 is
    never drawn (its cumulative value equals its predecessor's). -1 for a row of -inf only.

    ``logits`` holds no NaN or +inf (see process_logits), so a row with a finite logit has a CDF
    of finite values whose total is at least 1 / vocab, and ``target < total`` keeps the search
    inside the row even where rounding makes the CDF not quite monotone."""
    cdf = logits.softmax(dim=-1).cumsum_(dim=-1)
    total = cdf[:, -1:]
    target = _uniforms(generators, logits.device)[:, None] * total
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
