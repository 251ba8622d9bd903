"""The sampler's draw through tandem's CPU kernel (``cpu_ops.draw_rows``, kernels/cpu/sampling.cpp)
against torch's softmax + cumsum + searchsorted draw on the same uniform numbers, against the
distribution itself (chi-square), with seeds, and wired in by the worker only with tandem's
kernels; the greedy argmax kernel (``cpu_ops.argmax_rows``) against torch's ``max``."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM
from tandem.kernels import cpu_ops
from tandem.sampling_params import SamplingParams
from tandem.worker.sampler import Sampler, _draw, make_generator
from tandem.worker.sampling_row import SamplingRow
from tests.helpers.tiny_models import tiny_model_dir

EOS = 2
CHI2_7DF_P999 = 24.32  # 99.9th percentile of the chi-square distribution, 7 degrees of freedom


@pytest.fixture(scope="module")
def argmax_rows():
    assert cpu_ops.load(), "the CPU kernels build on this machine"
    return cpu_ops.argmax_rows


@pytest.fixture(scope="module")
def draw_rows():
    assert cpu_ops.load(), "the CPU kernels build on this machine"
    return cpu_ops.draw_rows


def kernel_sampler(draw_rows) -> Sampler:
    return Sampler(cpu_kernels=True)


def row(params, generator=None) -> SamplingRow:
    return SamplingRow(params, generator, [5, 6], [], frozenset({EOS}))


@pytest.mark.parametrize("vocab", [1, 7, 256, 257, 32000])
def test_the_kernel_draws_the_tokens_torch_draws_from_the_same_numbers(draw_rows, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(300, vocab, generator=gen) * 4
    # filtered tokens (as top-k / top-p / min-p leave them), huge and tiny magnitudes, one token left
    logits[::3, vocab // 2:] = float("-inf")
    logits[1] *= 1e30
    logits[2] *= 1e-30
    logits[4, :] = float("-inf")
    logits[4, vocab - 1] = 3.0
    logits[5] = float("-inf")  # nothing left: -1
    generators = [make_generator(i, 0, "cpu") if i % 2 else None for i in range(300)]
    torch.manual_seed(0)
    expected = _draw(logits.clone(), generators)
    generators = [make_generator(i, 0, "cpu") if i % 2 else None for i in range(300)]
    torch.manual_seed(0)
    got = _draw(logits.clone(), generators, cpu_kernel=True)
    assert got.dtype == torch.long and got[5] == -1 and got[4] == vocab - 1
    # the two sum in different orders: only a number within rounding of a boundary of the
    # cumulative sums may land on a neighbouring token
    assert float((got == expected).float().mean()) >= 0.99
    drawn = got[got >= 0]
    assert bool(torch.isfinite(logits[got >= 0].gather(1, drawn[:, None])).all()), "a filtered token was drawn"


def test_logits_that_span_hundreds_draw_as_torch_draws(draw_rows):
    # an untrained model's logits: most tokens lie more than 87 below the row's max, where the
    # vector exp leaves its fast path (the kernel clamps there; those tokens get probability 0)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(400, 3000, generator=gen) * 60
    logits[::4, :1500] = float("-inf")
    torch.manual_seed(12)
    expected = _draw(logits.clone(), [None] * 400)  # torch's softmax, cumsum and searchsorted
    torch.manual_seed(12)
    got = _draw(logits.clone(), [None] * 400, cpu_kernel=True)
    assert float((got == expected).float().mean()) >= 0.99
    assert bool(torch.isfinite(logits.gather(1, got[:, None])).all()), "a filtered token was drawn"


def test_a_token_far_below_the_max_is_never_drawn(draw_rows):
    # probabilities by hand: exp(-100) / (1 + exp(-100)) is below 1e-43; exp(-5) is not
    logits = torch.tensor([[0.0, -100.0, -5.0]]).repeat(2000, 1)
    uniforms = torch.linspace(0, 1 - 1e-7, 2000)
    got = torch.empty(2000, dtype=torch.long)
    draw_rows(got, logits, uniforms)
    assert set(got.tolist()) == {0, 2}
    share = float((got == 2).float().mean())
    assert abs(share - torch.tensor(-5.0).exp().item() / (1 + torch.tensor(-5.0).exp().item())) < 2e-3


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 31, 32, 33, 71, 32000])
def test_the_argmax_kernel_picks_what_torch_max_picks(argmax_rows, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(50, vocab, generator=gen) * 30
    logits[1] = torch.randint(0, 3, (vocab,), generator=gen).float()  # ties: the first index wins
    logits[2] = float("-inf")  # -inf only: index 0, as torch
    logits[3, vocab // 2] = float("inf")
    logits[4] = 7.0
    logits[5, -1] = 1e30
    got = torch.empty(50, dtype=torch.long)
    argmax_rows(got, logits)
    assert got.tolist() == logits.max(dim=-1).indices.tolist()


@pytest.mark.parametrize("where", [0, 5, 8, 31, -1])
def test_the_argmax_kernel_flags_a_row_with_a_nan(argmax_rows, where):
    logits = torch.randn(3, 32)
    logits[1, where] = float("nan")
    got = torch.empty(3, dtype=torch.long)
    argmax_rows(got, logits)
    assert got[1] == -1
    assert got[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()


def test_the_greedy_sampler_with_the_argmax_kernel_matches_torch(argmax_rows):
    sampler = Sampler(cpu_kernels=True)
    params = SamplingParams(temperature=0.0)
    logits = torch.randn(16, 1000) * 5
    expected = Sampler()(logits.clone(), [row(params) for _ in range(16)]).token_ids
    assert sampler(logits.clone(), [row(params) for _ in range(16)]).token_ids == expected
    logits[3, 7] = float("nan")  # sanitized first, by either path: the NaN becomes -inf
    expected = Sampler()(logits.clone(), [row(params) for _ in range(16)]).token_ids
    assert sampler(logits.clone(), [row(params) for _ in range(16)]).token_ids == expected


@pytest.mark.parametrize("seeded", [True, False], ids=["own-generators", "default-generator"])
def test_kernel_draws_follow_the_processed_distribution(draw_rows, seeded):
    torch.manual_seed(4)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.9, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, -4.0])
    params = SamplingParams(temperature=0.8, top_k=8, seed=7 if seeded else None)
    # softmax(logits / 0.8) over the 8 largest, by hand
    expected = torch.zeros(len(logits))
    expected[:8] = torch.softmax(logits[:8] / 0.8, dim=-1)
    num_draws = 20000
    rows = [row(params, make_generator(seed, 0, "cpu") if seeded else None) for seed in range(num_draws)]
    tokens = kernel_sampler(draw_rows)(logits.repeat(num_draws, 1), rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=len(logits)).float()
    assert counts[8:].sum() == 0
    chi2 = float(((counts[:8] - expected[:8] * num_draws) ** 2 / (expected[:8] * num_draws)).sum())
    assert chi2 < CHI2_7DF_P999


def test_a_seeded_request_draws_what_it_draws_without_the_kernel(draw_rows):
    torch.manual_seed(5)
    steps_logits = torch.randn(20, 2000) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(sampler):
        generator = make_generator(params.seed, 0, "cpu")
        return [sampler(step[None].clone(), [row(params, generator)]).token_ids[0] for step in steps_logits]

    with_kernel = run(kernel_sampler(draw_rows))
    assert with_kernel == run(kernel_sampler(draw_rows))
    assert with_kernel == run(Sampler())


@pytest.mark.parametrize("cpu_kernels,expected", [("tandem", True), ("torch", False)])
def test_the_worker_uses_the_kernel_only_with_tandems_kernels(cpu_kernels, expected):
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=32, cpu_kernels=cpu_kernels)
    sampler = llm.engine.executor.worker.runner.sampler
    assert sampler.cpu_kernels == expected
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=3, max_tokens=5))
    assert len(out[0].outputs[0].token_ids) == 5


@pytest.mark.parametrize("vocab", [5, 40])
def test_the_argmax_kernel_takes_the_first_of_signed_zeros(argmax_rows, vocab):
    logits = torch.full((2, vocab), -1.0)
    logits[0, 1:] = 0.0
    logits[0, 2] = -0.0  # equal to +0.0: the first zero (index 1) wins, as torch's max
    logits[1, 3:] = -0.0
    logits[1, -1] = 0.0
    got = torch.empty(2, dtype=torch.long)
    argmax_rows(got, logits)
    assert got.tolist() == logits.max(dim=-1).indices.tolist() == [1, 3]
