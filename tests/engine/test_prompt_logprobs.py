"""Prompt logprobs through the whole offline engine against log_softmax of HF transformers'
forward pass on the prompt: prompt-only requests (max_tokens 0), prompts computed in chunks,
and prompts computed again after a preemption."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import hf_model, tiny_model_dir

TOLERANCE = 1e-4  # float32, two implementations of the same forward pass


@pytest.fixture(scope="module")
def path():
    return tiny_model_dir("llama")


def hf_prompt_logprobs(path, prompt: list[int]) -> torch.Tensor:
    """Row ``p - 1`` holds the distribution of prompt token ``p``."""
    with torch.inference_mode():
        return torch.log_softmax(hf_model(path)(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against_hf(entries, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        row, entry = ref[pos - 1], entries[pos]
        assert abs(entry[prompt[pos]].logprob - row[prompt[pos]].item()) < TOLERANCE
        assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1
        for token in row.topk(k).indices.tolist():
            assert abs(entry[token].logprob - row[token].item()) < TOLERANCE


def test_max_tokens_0_computes_the_prompt_only(path):
    llm = LLM(model=str(path), num_kv_blocks=64)
    prompts = _prompts(51, [1, 17, 40])
    outs = llm.generate(prompts, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for prompt, out in zip(prompts, outs):
        (seq,) = out.outputs
        assert (seq.token_ids, seq.text, seq.finish_reason) == ([], "", "length")
        check_against_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(path, prompt), 3)
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_0_with_n_gives_n_empty_sequences(path):
    llm = LLM(model=str(path), num_kv_blocks=64)
    out = llm.generate([_prompts(52, [20])[0]], SamplingParams(max_tokens=0, n=3, prompt_logprobs=0))[0]
    assert [(s.index, s.token_ids, s.finish_reason) for s in out.outputs] == [(i, [], "length") for i in range(3)]
    assert len(out.prompt_logprobs) == 20
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


def test_a_prompt_computed_in_chunks_has_every_position(path):
    llm = LLM(model=str(path), num_kv_blocks=64, max_num_batched_tokens=16)
    prompt = _prompts(53, [70])[0]  # five chunks of at most 16 tokens
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    check_against_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(path, prompt), 2)


def test_a_preempted_prompt_keeps_one_entry_per_position(path):
    # 10 usable blocks of 16 tokens cannot hold six sequences of up to 64 tokens at once.
    llm = LLM(model=str(path), num_kv_blocks=11, max_num_batched_tokens=64)
    prompts = _prompts(54, [30, 31, 29, 17, 40, 12])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                prompt_logprobs=1))
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    for prompt, out in zip(prompts, outs):
        check_against_hf(out.prompt_logprobs, prompt, hf_prompt_logprobs(path, prompt), 1)
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
