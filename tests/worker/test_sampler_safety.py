"""The real sampler under every admitted parameter value and hostile logits (+inf, -inf, NaN):
a hypothesis property test of the invariants in sampler.py's module docstring, checked against a
reference of its rules written here (which tokens a row may take, its fallback token), and
hand-worked cases for the values that used to kill the engine (issue 11)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.sampling_params import SamplingParams
from tandem.worker.sampler import Sampler, compute_logprobs, make_generator
from tandem.worker.sampling_row import SamplingRow

INF, NAN = math.inf, math.nan
F32_MAX = torch.finfo(torch.float32).max
F32_LOWEST = torch.finfo(torch.float32).min
EOS = frozenset({1, 3})

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ]),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """These tensors are tiny: a second OpenMP thread only adds waits (20x slower on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def either(extremes, floats):
    """The named extremes, often, and anything in between."""
    return st.one_of(st.sampled_from(extremes), floats)


TEMPERATURES = either(
    [0.0, 5e-324, 1e-300, 1e-45, 1e-38, 1e-10, 0.5, 1.0, 2.0, 1e10, 1e38, 1e39, 1e300],
    st.floats(1e-300, 1e300),
)
REPETITION_PENALTIES = either(
    [5e-324, 1e-300, 1e-45, 1e-10, 0.5, 1.0, 1.3, 1e10, 1e39, 1e300, 1e308],
    st.floats(5e-324, 1e308),
)
PRESENCE_FREQUENCY = either([-2.0, -1e-30, 0.0, 1e-30, 2.0], st.floats(-2.0, 2.0))
TOP_P = either([5e-324, 1e-300, 1e-45, 1e-38, 1e-8, 0.5, 0.9, 1.0 - 1e-9, 1.0],
               st.floats(0.0, 1.0, exclude_min=True))
MIN_P = either([0.0, 5e-324, 1e-300, 1e-40, 0.1, 0.5, 1.0 - 1e-9, 1.0], st.floats(0.0, 1.0))
LOGIT_SCALES = st.sampled_from([0.0, 1e-40, 1e-3, 1.0, 10.0, 1e4, 1e30, 1e38])
SPECIAL_LOGITS = st.sampled_from([INF, -INF, NAN, F32_MAX, -F32_MAX, 0.0, 1e-45, -1e-45])
ROW_KINDS = st.sampled_from(["random"] * 6 + ["all -inf", "all nan", "all +inf", "constant"])


@st.composite
def sampling_rows(draw, vocab: int):
    """(params, prompt, output, raw logits [vocab], allowed mask or None) of one row."""
    top_k = draw(st.one_of(st.sampled_from([-1, 0, 1, 2, vocab - 1, vocab, vocab + 1, 10**9]),
                           st.integers(-1, 2 * vocab)))
    stop_ids = draw(st.one_of(
        st.lists(st.integers(0, vocab - 1), max_size=4),
        st.just(list(range(vocab))),
        st.just(list(range(0, vocab, 2))),
        st.just([t for t in range(vocab) if t not in EOS]),
    ))
    params = SamplingParams(
        temperature=draw(TEMPERATURES),
        top_p=draw(TOP_P),
        top_k=top_k,
        min_p=draw(MIN_P),
        presence_penalty=draw(PRESENCE_FREQUENCY),
        frequency_penalty=draw(PRESENCE_FREQUENCY),
        repetition_penalty=draw(REPETITION_PENALTIES),
        seed=draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))),  # the admitted range
        max_tokens=None,
        min_tokens=draw(st.integers(0, 3)),
        stop_token_ids=stop_ids,
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        logit_bias=draw(st.one_of(st.none(), st.dictionaries(
            st.integers(0, vocab - 1), either([-100.0, -1e-30, 0.0, 100.0], st.floats(-100.0, 100.0)),
            max_size=8))),
        allowed_token_ids=draw(st.one_of(st.none(), st.lists(st.integers(0, vocab - 1), min_size=1,
                                                             max_size=6))),
    )
    prompt = draw(st.lists(st.integers(0, vocab - 1), max_size=12))
    output = draw(st.lists(st.integers(0, vocab - 1), max_size=4))
    params.bad_words_token_ids = draw(st.one_of(st.none(), st.lists(_bad_word(output, vocab), min_size=1,
                                                                    max_size=4)))
    logits = _raw_logits(draw, vocab)
    allowed = draw(st.one_of(st.none(), st.sampled_from(["none", "all", "some", "few"])))
    if allowed is not None:
        density = {"none": 0.0, "all": 1.0, "some": 0.5, "few": 0.03}[allowed]
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        allowed = torch.rand(vocab, generator=gen) < density
    return params, prompt, output, logits, allowed


def _bad_word(output: list[int], vocab: int):
    """A token sequence that the outputs end with its prefix of (so its last token is banned),
    or any sequence."""
    token = st.integers(0, vocab - 1)
    suffixes = [output[len(output) - k:] for k in range(len(output) + 1)]
    completed = st.tuples(st.sampled_from(suffixes), token).map(lambda pair: pair[0] + [pair[1]])
    return st.one_of(completed, st.lists(token, min_size=1, max_size=3))


def _raw_logits(draw, vocab: int) -> torch.Tensor:
    kind = draw(ROW_KINDS)
    if kind != "random":
        value = {"all -inf": -INF, "all nan": NAN, "all +inf": INF}.get(kind, draw(SPECIAL_LOGITS))
        return torch.full((vocab,), value)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    logits = (torch.randn(vocab, generator=gen, dtype=torch.float64) * draw(LOGIT_SCALES)).float()
    # A fraction of the entries, anywhere, replaced by special values.
    fraction = draw(st.sampled_from([0.0, 0.0, 0.02, 0.2, 0.6, 0.95]))
    specials = torch.tensor(draw(st.lists(SPECIAL_LOGITS, min_size=1, max_size=3)))
    replaced = torch.rand(vocab, generator=gen) < fraction
    choice = torch.randint(len(specials), (vocab,), generator=gen)
    return torch.where(replaced, specials[choice], logits)


@st.composite
def batches(draw):
    vocab = draw(st.sampled_from([64, 100, 257, 512]))
    return vocab, draw(st.lists(sampling_rows(vocab), min_size=1, max_size=8))


def build_rows(batch, device, group_sizes=None):
    """SamplingRows with fresh generators; ``group_sizes[j]`` consecutive seeded rows share one
    generator (a request verifying drafts samples several rows from its stream)."""
    rows, generator, left = [], None, 0
    for j, (params, prompt, output, _, allowed) in enumerate(batch):
        if params.seed is not None and left == 0:
            generator, left = make_generator(params.seed, j, device), (group_sizes or {}).get(j, 1)
        left = left - 1 if params.seed is not None else left
        rows.append(SamplingRow(
            params, generator if params.seed is not None else None, prompt, output, EOS,
            allowed.to(device) if allowed is not None else None,
        ))
    return rows


def sample(batch, device, group_sizes=None):
    logits = torch.stack([raw for _, _, _, raw, _ in batch]).to(device)
    return Sampler()(logits, build_rows(batch, device, group_sizes))


def sanitized(raw: torch.Tensor) -> torch.Tensor:
    """The rule of the module docstring: NaN is -inf; a row with +inf keeps only those, as 0."""
    row = torch.where(raw.isnan(), -INF, raw.double())
    if bool(row.isposinf().any()):
        row = torch.where(row.isposinf(), 0.0, -INF)
    return row


def reference_fallback(raw: torch.Tensor, allowed: torch.Tensor | None = None) -> int:
    """The argmax of the sanitized raw logits (first of ties), token 0 where all are -inf; with
    a structured-output mask that allows something, the same among the allowed tokens (the
    first allowed one where all of them are -inf)."""
    row = sanitized(raw)
    if allowed is not None and bool(allowed.any()):
        candidates = torch.nonzero(allowed).flatten()
        finite = candidates[row[candidates].isfinite()]
        if not len(finite):
            return int(candidates[0])
        return int(finite[row[finite] == row[finite].max()][0])
    finite = row.isfinite()
    if not bool(finite.any()):
        return 0
    return int(torch.nonzero(row == row[finite].max())[0])


def permitted(params, output, raw, allowed) -> set[int]:
    """Tokens a row may take while anything is left: finite after sanitizing, allowed by the
    mask and ``allowed_token_ids``, not banned by a bad word (the outputs end with all of it but
    its last token) or min_tokens. The logit bias, penalties, temperature and the filters never
    empty it."""
    ok = sanitized(raw).isfinite()
    if allowed is not None:
        ok &= allowed
    if params.allowed_token_ids is not None:
        only = torch.zeros_like(ok)
        only[params.allowed_token_ids] = True
        ok &= only
    banned = {ids[-1] for ids in params.bad_words_token_ids or ()
              if len(ids) - 1 <= len(output) and output[len(output) - len(ids) + 1:] == ids[:-1]}
    if len(output) < params.min_tokens:
        banned |= set(params.stop_token_ids) | (set() if params.ignore_eos else set(EOS))
    ok[list(banned)] = False
    return set(torch.nonzero(ok).flatten().tolist())


def check_invariants(batch, out, vocab):
    for (params, _, output, raw, allowed), token, entry in zip(batch, out.token_ids, out.logprobs):
        assert 0 <= token < vocab
        left = permitted(params, output, raw, allowed)
        if left:
            assert token in left, (token, sorted(left)[:10], params)
        else:
            assert token == reference_fallback(raw, allowed), params
        if params.logprobs is None:
            assert entry is None
            continue
        assert entry.token_id == token and entry.rank >= 1
        values = [lp for _, lp, _ in entry.top]
        assert all(math.isfinite(v) and v <= 0.0 for v in values + [entry.logprob])
        assert values == sorted(values, reverse=True)
        assert [r for _, _, r in entry.top] == list(range(1, min(params.logprobs, vocab) + 1))
        if entry.top:
            assert entry.logprob <= values[0]
        if not bool(sanitized(raw).isfinite().any()):
            assert entry.logprob == F32_LOWEST


def check_seeded_rows_repeat(batch, out, device):
    """Seeded rows: the same tokens from fresh generators, in a batch of another composition (the
    unseeded rows gone, the rest reversed, a plain greedy row in front)."""
    again = sample(batch, device)
    seeded = [j for j, (params, *_) in enumerate(batch) if params.seed is not None]
    for j in seeded:
        assert again.token_ids[j] == out.token_ids[j]
    if not seeded:
        return
    vocab = batch[0][3].shape[0]
    mate = (SamplingParams(temperature=0.0), [], [], torch.linspace(0, 1, vocab), None)
    # make_generator(seed, j) keys the stream on the original position j: carry it as the index.
    reordered = [mate] + [batch[j] for j in reversed(seeded)]
    rows = build_rows(reordered, device)
    for k, j in enumerate(reversed(seeded), start=1):
        rows[k].generator = make_generator(batch[j][0].seed, j, device)
    logits = torch.stack([raw for _, _, _, raw, _ in reordered]).to(device)
    moved = Sampler()(logits, rows)
    for k, j in enumerate(reversed(seeded), start=1):
        assert moved.token_ids[k] == out.token_ids[j]


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_any_admitted_values_give_tokens_in_range_and_finite_logprobs(data):
    vocab, batch = data
    out = sample(batch, "cpu")
    check_invariants(batch, out, vocab)
    check_seeded_rows_repeat(batch, out, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches())
def test_any_admitted_values_on_cuda(data):
    vocab, batch = data
    out = sample(batch, "cuda")
    check_invariants(batch, out, vocab)
    check_seeded_rows_repeat(batch, out, "cuda")


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.integers(2, 4))
def test_rows_sharing_a_generator_repeat(data, group):
    """Rows of one request verifying drafts draw in turn from one stream: rerun, the same."""
    vocab, batch = data
    seeded = [j for j, (params, *_) in enumerate(batch) if params.seed is not None]
    sizes = {seeded[0]: group} if seeded else None
    out = sample(batch, "cpu", sizes)
    check_invariants(batch, out, vocab)
    again = sample(batch, "cpu", sizes).token_ids
    assert [again[j] for j in seeded] == [out.token_ids[j] for j in seeded]


# Hand-worked cases. LOGITS: token 1 is the most likely, then 3, 0, 4, 5, 2.
LOGITS = [1.0, 3.0, -2.0, 2.5, 0.0, -1.0]


def draw_many(logits, params, device, prompt=(), allowed=None, copies=200):
    """Tokens of ``copies`` rows of the same logits and params, half of them seeded."""
    rows = [SamplingRow(params, make_generator(j, 0, device) if j % 2 else None, list(prompt), [], EOS,
                        allowed.to(device) if allowed is not None else None)
            for j in range(copies)]
    out = Sampler()(torch.tensor([logits] * copies, device=device), rows)
    for entry in out.logprobs:
        assert entry is None or math.isfinite(entry.logprob)
    return out


def test_repetition_penalty_5e_324_saturates_a_seen_positive_logit(device):
    # Seen tokens 0 (1.0) and 2 (-2.0): 1.0 / 5e-324 overflows and saturates at float32's max,
    # -2.0 * 5e-324 is -1e-323, a float32 -0.0. Token 0 (float32 max) dwarfs the rest: at any
    # temperature it is the only token with a probability above 0.
    for params in [SamplingParams(temperature=0.0, repetition_penalty=5e-324, logprobs=20),
                   SamplingParams(temperature=1.0, repetition_penalty=5e-324, logprobs=20)]:
        out = draw_many(LOGITS, params, device, prompt=[0, 2])
        assert set(out.token_ids) == {0}
        # The logprob is the raw model's: log_softmax(LOGITS)[0], rank 3 (after tokens 1 and 3).
        assert out.logprobs[0].logprob == pytest.approx(
            float(torch.log_softmax(torch.tensor(LOGITS), -1)[0]), abs=1e-6)
        assert out.logprobs[0].rank == 3 and len(out.logprobs[0].top) == 6


def test_repetition_penalty_1e308_keeps_a_seen_negative_logit_finite(device):
    # The JSON mask allows token 2 (-2.0) alone, which the prompt holds: -2.0 * 1e308 overflows
    # and saturates at -float32 max; still finite, so token 2 is sampled, not the fallback (1).
    allowed = torch.tensor([False, False, True, False, False, False])
    for temperature in [0.0, 1.0]:
        params = SamplingParams(temperature=temperature, repetition_penalty=1e308, logprobs=20)
        assert set(draw_many(LOGITS, params, device, prompt=[2], allowed=allowed).token_ids) == {2}
    # Seen tokens 1 (3.0) and 3 (2.5) become 3e-308 and 2.5e-308, float32 zeros: token 0 (1.0) is
    # now the largest.
    params = SamplingParams(temperature=0.0, repetition_penalty=1e308)
    assert set(draw_many(LOGITS, params, device, prompt=[1, 3]).token_ids) == {0}


def test_top_p_5e_324_keeps_the_single_most_likely_token(device):
    # The nucleus holds the most likely token, and the next only if the mass before it (token
    # 1's probability, 0.54) were below top_p: token 1 alone.
    params = SamplingParams(temperature=1.0, top_p=5e-324, logprobs=20)
    assert set(draw_many(LOGITS, params, device).token_ids) == {1}


def test_temperature_1e_300_is_the_argmax_or_a_tie_with_it(device):
    # 3.0 / 1e-300 overflows: effectively greedy, token 1.
    params = SamplingParams(temperature=1e-300, logprobs=20)
    assert set(draw_many(LOGITS, params, device).token_ids) == {1}
    # Tokens 1 and 3 tie at 3.0: each has probability 1/2 (200 draws show both: 1 - 2^-199).
    assert set(draw_many([1.0, 3.0, -2.0, 3.0], params, device).token_ids) == {1, 3}
    # A largest logit of 0 does not overflow (0 / 1e-300 = 0); -1 / 1e-300 is -1e300, so token 1
    # has probability 0 and tokens 0 and 2 share it all.
    assert set(draw_many([0.0, -1.0, 0.0], params, device).token_ids) == {0, 2}


# 99.9th percentile of the chi-square distribution with 4 degrees of freedom.
CHI2_4DF_P999 = 18.47


def test_temperature_1e300_is_uniform_over_the_tokens_left(device):
    # Every finite logit / 1e300 is ~1e-300, exp of which is 1: uniform over the 5 finite tokens;
    # token 2 (-inf, excluded) never comes.
    logits = [1.0, 3.0, -math.inf, 2.5, 0.0, -1.0]
    tokens = draw_many(logits, SamplingParams(temperature=1e300, logprobs=20), device, copies=5000).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    assert counts[2] == 0
    expected = 5000 / 5
    assert float(((counts[[0, 1, 3, 4, 5]] - expected) ** 2 / expected).sum()) < CHI2_4DF_P999


def test_min_p_1_keeps_only_the_ties_with_the_max(device):
    # prob >= 1 * max prob: tokens 0 and 3 (both 3.0), each with probability 1/2.
    params = SamplingParams(temperature=1.0, min_p=1.0, logprobs=20)
    assert set(draw_many([3.0, 1.0, 2.9, 3.0], params, device).token_ids) == {0, 3}


def test_top_k_1e9_filters_nothing(device):
    # k beyond the vocabulary keeps all 4 finite tokens (equal logits: 1/4 each; 200 draws show
    # all of them but with probability ~4 * 0.75^200); token 3 (-inf) never comes.
    params = SamplingParams(temperature=1.0, top_k=10**9, logprobs=20)
    assert set(draw_many([0.0, 0.0, 0.0, -math.inf, 0.0], params, device).token_ids) == {0, 1, 2, 4}


def test_infinite_and_nan_logits(device):
    # Tokens 1 and 3 are +inf: they share all the probability; NaN (token 4) is excluded.
    row = [1.0, math.inf, 2.0, math.inf, math.nan]
    out = draw_many(row, SamplingParams(temperature=1.0, logprobs=2), device)
    assert set(out.token_ids) == {1, 3}
    entry = out.logprobs[0]
    assert entry.logprob == pytest.approx(math.log(0.5)) and entry.rank == 1
    assert [lp for _, lp, _ in entry.top] == pytest.approx([math.log(0.5)] * 2)
    # Greedy takes the first +inf; a plain greedy batch (the argmax fast path) skips NaN.
    assert set(draw_many(row, SamplingParams(temperature=0.0), device).token_ids) == {1}
    assert draw_many([math.nan, 1.0, 5.0, math.nan], SamplingParams(temperature=0.0), device).token_ids[0] == 2
    # All NaN: no finite logit, token 0; every logprob is float32's lowest.
    out = draw_many([math.nan] * 4, SamplingParams(temperature=0.7, top_p=0.5, logprobs=3), device)
    assert set(out.token_ids) == {0}
    assert out.logprobs[0].logprob == F32_LOWEST and out.logprobs[0].rank == 1


def test_a_row_with_nothing_left_takes_the_raw_argmax(device):
    # The fallback ignores the bans and the penalties (and an empty mask): token 1 (3.0) each
    # time; a mask that allows something keeps the fallback inside it (the grammar wins).
    nothing = torch.zeros(6, dtype=torch.bool)
    only_minus_inf = torch.tensor([False, False, True, False, False, False])
    everything = list(range(6))
    for temperature in [0.0, 0.8]:
        params = SamplingParams(temperature=temperature, repetition_penalty=1e308, logprobs=1)
        assert set(draw_many(LOGITS, params, device, prompt=[1], allowed=nothing).token_ids) == {1}
        minus_inf = [1.0, 3.0, -math.inf, 2.5, 0.0, -1.0]
        assert set(draw_many(minus_inf, params, device, allowed=only_minus_inf).token_ids) == {2}
        banned = SamplingParams(temperature=temperature, min_tokens=2, stop_token_ids=everything)
        assert set(draw_many(LOGITS, banned, device).token_ids) == {1}
        grammar_end = torch.tensor([False, False, False, True, False, True])  # 2.5 and -1.0 allowed
        assert set(draw_many(LOGITS, banned, device, allowed=grammar_end).token_ids) == {3}


def test_compute_logprobs_are_finite_for_non_finite_logits(device):
    logits = torch.tensor([[0.0, math.inf, math.nan, -math.inf], [math.nan] * 4, [0.0, 0.0, -math.inf, 1.0]],
                          device=device)
    entries = compute_logprobs(logits, [2, 3, 2], 2)
    # Row 0: token 1 (+inf) has all the probability, token 2 (NaN) none.
    assert entries[0].logprob == F32_LOWEST and entries[0].top[0][:2] == (1, 0.0)
    assert entries[1].logprob == F32_LOWEST and entries[1].rank == 1
    assert entries[2].logprob == F32_LOWEST and entries[2].rank == 4
