"""The sampler against independent oracles: HF transformers' logits processors, torch's own
argmax/log_softmax, hand-computed penalties and the empirical distribution of many draws."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.sampling_params import SamplingParams
from tandem.worker.logits_processing import process_logits
from tandem.worker.sampler import Sampler, compute_logprobs, make_generator
from tandem.worker.sampling_row import SamplingRow, TokenSpan

EOS = 2

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


def row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    """A row as the model runner builds it: spans over the request's one token list."""
    tokens = list(prompt) + list(output)
    return SamplingRow(params, generator, TokenSpan(tokens, 0, len(prompt)), TokenSpan(tokens, len(prompt), len(tokens)),
                       frozenset({EOS}))


def hf_processed(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row [V] through transformers' own processors, in the order the sampler documents."""
    p = r.params
    scores = logits[None].clone()
    ids = torch.tensor([list(r.prompt_token_ids) + list(r.output_token_ids)], dtype=torch.long)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.greedy:
        return scores[0]
    warpers = []
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(ids, scores)
    return scores[0]


def assert_same_filtered_logits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(ours[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_greedy_rows_take_the_argmax(device):
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    expected = logits.argmax(dim=-1).tolist()
    logits = logits.to(device)
    plain = [row(SamplingParams(temperature=0.0)) for _ in range(16)]
    assert Sampler()(logits.clone(), plain).token_ids == expected
    # Logprobs on some rows leave the single-argmax fast path; the answer must not change.
    mixed = [row(SamplingParams(temperature=0.0, logprobs=2 if i % 3 else None)) for i in range(16)]
    assert Sampler()(logits.clone(), mixed).token_ids == expected


PROCESSOR_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(top_k=40),
    SamplingParams(top_p=0.8),
    SamplingParams(temperature=0.5, top_p=0.95),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=0.9, min_p=0.3),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, temperature=0.6),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(),
]


@pytest.mark.parametrize("scale", [0.3, 3.0], ids=["flat", "peaked"])
def test_processed_logits_equal_transformers_processors(scale, device):
    """Rows with different params share one batch; each must equal HF on its own. The flat case
    has nuclei wider than the top-p candidate window, the peaked case narrow ones."""
    torch.manual_seed(1)
    vocab = 3000
    logits = torch.randn(len(PROCESSOR_CASES), vocab) * scale
    rows = [
        row(params, prompt=torch.randint(vocab, (30,)).tolist(), output=torch.randint(vocab, (9,)).tolist())
        for params in PROCESSOR_CASES
    ]
    processed = logits.to(device, copy=True)
    process_logits(processed, rows)
    processed = processed.cpu()
    for i, r in enumerate(rows):
        assert_same_filtered_logits(processed[i], hf_processed(logits[i], r))


def test_top_p_alone_equals_transformers_on_many_rows(device):
    torch.manual_seed(2)
    logits = torch.randn(64, 500) * torch.linspace(0.1, 4.0, 64)[:, None]
    params = [SamplingParams(top_p=p) for p in torch.linspace(0.05, 0.99, 64).tolist()]
    processed = logits.to(device, copy=True)
    process_logits(processed, [row(p) for p in params])
    processed = processed.cpu()
    for i, p in enumerate(params):
        expected = TopPLogitsWarper(p.top_p)(None, logits[i : i + 1].clone())[0]
        assert_same_filtered_logits(processed[i], expected)


def test_presence_and_frequency_penalties_hand_computed(device):
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 0.0, 3.0]], device=device)
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Token 4 appears in the prompt only: OpenAI penalties count output tokens alone.
    r = row(params, prompt=[4, 4], output=[1, 1, 3, 1])
    process_logits(logits, [r])
    # token 1: count 3 -> 2.0 - 0.5 - 0.75; token 3: count 1 -> 0.5 - 0.5 - 0.25
    assert logits[0].tolist() == [1.0, 0.75, -1.0, -0.25, 0.0, 3.0]


def test_sampled_tokens_lie_in_the_allowed_set(device):
    torch.manual_seed(3)
    vocab = 400
    params = [
        SamplingParams(top_k=7),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=1.5, top_k=20, top_p=0.7, min_p=0.1),
    ]
    base = torch.randn(len(params), vocab) * 2
    allowed = [set(torch.nonzero(~torch.isinf(hf_processed(base[i], row(p)))).flatten().tolist())
               for i, p in enumerate(params)]
    copies = 200
    rows = [row(p) for p in params] * copies
    tokens = Sampler()(base.repeat(copies, 1).to(device), rows).token_ids
    for j, token in enumerate(tokens):
        assert token in allowed[j % len(params)]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of the chi-square distribution with 7 degrees of freedom.
CHI2_7DF_P999 = 24.32


@pytest.mark.parametrize("seeded", [True, False], ids=["own-generators", "default-generator"])
def test_draws_follow_the_processed_distribution(seeded, device):
    torch.manual_seed(4)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, -4.0])
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.99, seed=7 if seeded else None)
    expected = torch.softmax(hf_processed(logits, row(params)), dim=-1)
    allowed = expected > 0
    assert int(allowed.sum()) == 8, "the case should exercise the filters"
    num_draws = 20000
    rows = [row(params, generator=make_generator(seed, 0, device) if seeded else None)
            for seed in range(num_draws)]
    tokens = Sampler()(logits.repeat(num_draws, 1).to(device), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=len(logits)).float()
    assert counts[~allowed].sum() == 0
    assert chi_square(counts[allowed], expected[allowed]) < CHI2_7DF_P999


def test_one_generator_over_many_steps_follows_the_distribution(device):
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5, 0.2, -0.3, 0.8, -2.0]], device=device)
    params = SamplingParams(temperature=1.0, seed=3)
    generator = make_generator(3, 0, device)
    sampler = Sampler()
    tokens = [sampler(logits.clone(), [row(params, generator=generator)]).token_ids[0]
              for _ in range(4000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    assert chi_square(counts, torch.softmax(logits[0].cpu(), dim=-1)) < CHI2_7DF_P999


def run_seeded_sequence(steps_logits, seeded_params, device, batch_mates=None):
    """Tokens of one seeded row over several steps; ``batch_mates(step)`` gives (position,
    other rows' logits, other rows) to share each step's batch with."""
    generator = make_generator(seeded_params.seed, 0, device)
    output: list[int] = []
    sampler = Sampler()
    for step, step_logits in enumerate(steps_logits):
        mine = row(seeded_params, prompt=[5, 6, 7], output=list(output), generator=generator)
        if batch_mates is None:
            logits, rows, position = step_logits[None].clone(), [mine], 0
        else:
            position, other_logits, others = batch_mates(step)
            rows = others[:position] + [mine] + others[position:]
            logits = torch.cat([other_logits[:position], step_logits[None], other_logits[position:]])
        output.append(sampler(logits.to(device), rows).token_ids[position])
    return output


def test_seeded_row_is_reproducible_whatever_shares_the_batch(device):
    torch.manual_seed(5)
    vocab, steps = 2000, 12
    steps_logits = torch.randn(steps, vocab)
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=1234)
    alone = run_seeded_sequence(steps_logits, params, device)
    assert alone == run_seeded_sequence(steps_logits, params, device)

    mate_params = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5, top_k=10, seed=99),
        SamplingParams(top_p=0.5, presence_penalty=1.0, logprobs=3),
        SamplingParams(seed=1234),
    ]

    def batch_mates(step):
        count = 1 + step % len(mate_params)
        others = [row(mate_params[(step + j) % len(mate_params)], output=[1, 2],
                      generator=make_generator(step, j, device) if j % 2 else None)
                  for j in range(count)]
        return step % (count + 1), torch.randn(count, vocab) * 3, others

    assert run_seeded_sequence(steps_logits, params, device, batch_mates) == alone


def test_generators_of_one_request_give_distinct_streams(device):
    def draw(seed, index):
        return torch.rand(8, generator=make_generator(seed, index, device), device=device)

    draws = [draw(42, i) for i in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(draws[i], draws[j])
    assert torch.equal(draws[0], draw(42, 0))
    assert not torch.equal(draws[0], draw(43, 0))


def test_min_tokens_bans_eos_and_stop_token_ids(device):
    # EOS (2) and the stop id (4) are the two most likely tokens; token 0 comes next.
    logits = torch.tensor([[1.0, 0.0, 5.0, -1.0, 4.0]], device=device).repeat(4, 1)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    rows = [
        row(params, output=[1]),
        row(params, output=[1, 1, 1]),
        row(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True),
            output=[1]),
        row(SamplingParams(temperature=0.0, min_tokens=3), output=[1]),
    ]
    assert Sampler()(logits, rows).token_ids == [0, 2, 2, 4]


def test_min_tokens_bans_hold_when_sampling(device):
    logits = torch.tensor([[0.0, 0.0, 3.0, 0.0, 3.0]], device=device).repeat(500, 1)
    params = SamplingParams(min_tokens=2, stop_token_ids=[4])
    tokens = Sampler()(logits, [row(params) for _ in range(500)]).token_ids
    assert set(tokens) == {0, 1, 3}


def expected_logprob_entry(raw_logits: torch.Tensor, token: int, num_top: int):
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    order = torch.argsort(logprobs, descending=True)
    rank = order.tolist().index(token) + 1
    top = [(int(t), float(logprobs[t])) for t in order[:num_top]]
    return float(logprobs[token]), rank, top


def test_logprobs_are_the_raw_distribution(device):
    torch.manual_seed(6)
    logits = torch.randn(6, 300) * 2
    params = [
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(top_p=0.3, repetition_penalty=1.4, logprobs=7),
        SamplingParams(),
        SamplingParams(min_p=0.5, presence_penalty=2.0, logprobs=1),
    ]
    rows = [row(p, prompt=[1, 2, 3], output=[4, 5]) for p in params]
    out = Sampler()(logits.to(device, copy=True), rows)
    for i, p in enumerate(params):
        entry = out.logprobs[i]
        if p.logprobs is None:
            assert entry is None
            continue
        token = out.token_ids[i]
        logprob, rank, top = expected_logprob_entry(logits[i], token, p.logprobs)
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(logprob, abs=1e-5)
        assert entry.rank == rank
        assert [(t, r) for t, _, r in entry.top] == [(t, k + 1) for k, (t, _) in enumerate(top)]
        assert [lp for _, lp, _ in entry.top] == pytest.approx([lp for _, lp in top], abs=1e-5)


def test_compute_logprobs_over_many_rows(device):
    torch.manual_seed(7)
    logits = torch.randn(700, 50)  # more rows than one chunk
    token_ids = torch.randint(50, (700,)).tolist()
    entries = compute_logprobs(logits.to(device), token_ids, 3)
    for i in range(0, 700, 37):
        logprob, rank, top = expected_logprob_entry(logits[i], token_ids[i], 3)
        assert entries[i].token_id == token_ids[i]
        assert entries[i].logprob == pytest.approx(logprob, abs=1e-5)
        assert entries[i].rank == rank
        assert [t for t, _, _ in entries[i].top] == [t for t, _ in top]
    assert len(entries) == 700
    assert all(math.isfinite(e.logprob) for e in entries)


def test_logit_bias_is_added_before_the_argmax_hand_computed(device):
    # Token 2 (5.0) wins unbiased; -100 drops it to -95, +1.5 lifts token 4 (4.0) to 5.5.
    logits = torch.tensor([[1.0, 0.0, 5.0, -1.0, 4.0]], device=device).repeat(3, 1)
    rows = [row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.0, logit_bias={2: -100.0})),
            row(SamplingParams(temperature=0.0, logit_bias={4: 1.5}))]
    assert Sampler()(logits, rows).token_ids == [2, 4, 4]
    biased = logits[:1].clone()
    process_logits(biased, [row(SamplingParams(temperature=0.0, logit_bias={2: -100.0, 0: 100.0}))])
    assert biased[0].tolist() == [101.0, 0.0, -95.0, -1.0, 4.0]


def test_allowed_token_ids_are_the_only_tokens_drawn(device):
    torch.manual_seed(4)
    logits = (torch.randn(1, 300) * 3).repeat(400, 1).to(device)
    params = SamplingParams(temperature=1.5, allowed_token_ids=[3, 77, 299])
    tokens = Sampler()(logits, [row(params) for _ in range(400)]).token_ids
    assert set(tokens) == {3, 77, 299}
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=[3, 77, 299])
    best = max([3, 77, 299], key=lambda t: logits[0, t].item())
    assert Sampler()(logits[:1].clone(), [row(greedy)]).token_ids == [best]


def test_bad_words_ban_the_token_that_would_complete_them(device):
    # Greedy order: 2 (5.0), 4 (4.0), 0 (1.0). Words [2] (always banned), [7, 4] (4 banned after
    # 7), [9, 8, 4] (4 banned after 9, 8).
    logits = torch.tensor([[1.0, 0.0, 5.0, -1.0, 4.0, -2.0, -2.0, -2.0, -2.0, -2.0]], device=device)
    words = [[2], [7, 4], [9, 8, 4]]
    cases = [([], 4), ([7], 0), ([9], 4), ([8, 9], 4), ([9, 8], 0), ([9, 8, 7], 0), ([8, 9, 8], 0),
             ([7, 9], 4)]
    rows = [row(SamplingParams(temperature=0.0, bad_words=["x"], bad_words_token_ids=words), output=o)
            for o, _ in cases]
    assert Sampler()(logits.repeat(len(cases), 1), rows).token_ids == [want for _, want in cases]
