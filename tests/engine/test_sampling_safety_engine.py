"""The offline LLM completes requests with the extreme sampling values of issue 11 (and logits
that are themselves inf or NaN), with and without speculative decoding: every token inside the
vocabulary, every logprob finite, the engine still serving afterwards."""
from __future__ import annotations

import math
from itertools import count

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import TINY_VOCAB, tiny_model_dir, tiny_tokenizer

EXTREMES = [
    dict(repetition_penalty=5e-324),
    dict(repetition_penalty=1e308),
    dict(temperature=0.0, repetition_penalty=5e-324),
    dict(temperature=0.0, repetition_penalty=1e308, presence_penalty=2.0, frequency_penalty=-2.0),
    dict(top_p=5e-324),
    dict(temperature=1e-300),
    dict(temperature=1e300),
    dict(min_p=1.0),
    dict(top_k=10**9),
    dict(top_k=-1, top_p=5e-324, min_p=1.0, temperature=1e-300, repetition_penalty=5e-324),
    dict(presence_penalty=-2.0, frequency_penalty=2.0, temperature=1e300),
    dict(min_tokens=3, stop_token_ids=list(range(TINY_VOCAB))),  # every token banned
    dict(structured_outputs={"json_object": True}, repetition_penalty=5e-324, temperature=1e-300),
    dict(n=2, repetition_penalty=1e308, top_p=5e-324),
]


@pytest.fixture(scope="module", params=[0, 3], ids=["plain", "speculative"])
def llm(request):
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=256,
               num_speculative_tokens=request.param)


def _params(seed: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10, logprobs=20, seed=seed, **extreme) for extreme in EXTREMES]


def _check(outputs) -> None:
    for output in outputs:
        for position in output.prompt_logprobs or []:
            assert position is None or all(math.isfinite(lp.logprob) for lp in position.values())
        for completion in output.outputs:
            assert completion.token_ids
            assert all(0 <= t < TINY_VOCAB for t in completion.token_ids), completion.token_ids
            if completion.logprobs is None:
                continue
            assert len(completion.logprobs) == len(completion.token_ids)
            for step in completion.logprobs:
                assert all(math.isfinite(lp.logprob) for lp in step.values())
            assert math.isfinite(completion.cumulative_logprob)


def test_extreme_values_complete_with_tokens_in_range(llm):
    # A repetitive prompt gives the n-gram drafter drafts to verify.
    prompt = tiny_tokenizer().encode("ab ab ab ab ab ab ab ab")
    prompts = [prompt if i % 2 else p for i, p in enumerate(_prompts(21, [7] * len(EXTREMES)))]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate([prompts[0]], greedy)[0].outputs[0].token_ids
    _check(llm.generate(prompts, _params()))
    seeded = llm.generate(prompts, _params(seed=5))
    _check(seeded)
    again = llm.generate(prompts, _params(seed=5))
    assert [[c.token_ids for c in o.outputs] for o in again] == \
        [[c.token_ids for c in o.outputs] for o in seeded]
    # Still serving, and the same greedy output as before.
    assert llm.generate([prompts[0]], greedy)[0].outputs[0].token_ids == before


def test_non_finite_logits_from_the_model(llm, monkeypatch):
    """The model's logits get NaN, +inf and -inf entries, and whole rows of them."""
    model = llm.engine.executor.worker.model
    compute_logits = model.compute_logits
    calls = count()

    def hostile(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        step = next(calls)
        gen = torch.Generator().manual_seed(step)
        where = torch.rand(logits.shape, generator=gen) < 0.3
        choice = torch.randint(3, logits.shape, generator=gen)
        values = torch.tensor([math.nan, math.inf, -math.inf])[choice]
        logits = torch.where(where.to(logits.device), values.to(logits.device), logits)
        logits[step % logits.shape[0]] = [math.nan, -math.inf, math.inf][step % 3]
        return logits

    monkeypatch.setattr(model, "compute_logits", hostile)
    prompts = _prompts(22, [9] * len(EXTREMES))
    params = _params() + [SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=5),
                          SamplingParams(temperature=0.0, max_tokens=6)]
    outputs = llm.generate(prompts + prompts[:2], params)
    _check(outputs)
    assert len(outputs[-2].prompt_logprobs) == len(prompts[0])
