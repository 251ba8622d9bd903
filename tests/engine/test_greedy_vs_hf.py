"""Greedy output of the whole engine is token-identical to HF transformers' ``generate``.

The oracle runs each prompt alone through ``model.generate`` (float32, CPU); tandem runs them all
together under continuous batching, with prefix caching, chunked prefill, preemption and n > 1.
"""
from __future__ import annotations

import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.helpers.tiny_models import hf_model, is_tiny_model_dir, tiny_model_dir, tiny_tokenizer

MAX_TOKENS = 12


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tiny_tokenizer().all_special_ids)
    ordinary = [t for t in range(tiny_tokenizer().vocab_size) if t not in special]
    return [[rng.choice(ordinary) for _ in range(n)] for n in lengths]


MIXED_LENGTHS = [1, 3, 15, 16, 17, 33, 48, 70, 5]


_HF_GREEDY: dict[tuple[str, tuple[int, ...], int], list[int]] = {}
"""HF's answers on the tiny checkpoints, which are built once per process and never changed:
the engine, executor, transfer and model tests ask it for the same prompts again and again."""


def hf_greedy(path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    memo = _HF_GREEDY if is_tiny_model_dir(path) else {}
    keys = [(str(path), tuple(p), max_tokens) for p in prompts]
    missing = [k for k in keys if k not in memo]
    if missing:
        model = hf_model(path)
        with torch.inference_mode():
            for key in missing:
                ids = torch.tensor([key[1]])
                g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False)
                memo[key] = g[0, ids.shape[1]:].tolist()
    return [list(memo[k]) for k in keys]


def tandem_greedy(llm: LLM, prompts, max_tokens: int = MAX_TOKENS, n: int = 1):
    # min_tokens masks the EOS ids as HF's min_new_tokens does (ignore_eos would let them win).
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, n=n)
    return llm.generate(prompts, params)


@pytest.mark.parametrize("kind", ["llama", "llama3", "llama_tied", "qwen2", "mistral", "qwen3", "gemma3",
                                  "granite", "smollm3", "phi3"])
def test_mixed_batch_matches_hf(kind):
    path = tiny_model_dir(kind)
    prompts = _prompts(1, MIXED_LENGTHS)
    llm = LLM(model=str(path), num_kv_blocks=128)
    got = [o.outputs[0].token_ids for o in tandem_greedy(llm, prompts)]
    assert got == hf_greedy(path, prompts)


def test_prefix_caching_hits_and_matches_hf():
    path = tiny_model_dir("llama")
    shared = _prompts(2, [40])[0]
    tails = _prompts(3, [1, 5, 9, 16, 20])
    prompts = [shared + t for t in tails] + [shared[:33]]
    llm = LLM(model=str(path), num_kv_blocks=128, enable_prefix_caching=True)
    first = tandem_greedy(llm, prompts[:1])
    rest = tandem_greedy(llm, prompts[1:])
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == hf_greedy(path, prompts)
    assert all(o.num_cached_tokens >= 32 for o in rest)
    stats = llm.engine.scheduler.kv.stats()
    assert stats.prefix_cache_hits >= 32 * len(rest)


def test_chunked_prefill_matches_hf():
    path = tiny_model_dir("qwen2")
    prompts = _prompts(4, [70, 45, 2, 33])
    llm = LLM(model=str(path), num_kv_blocks=128, max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    got = [o.outputs[0].token_ids for o in tandem_greedy(llm, prompts)]
    assert got == hf_greedy(path, prompts)


def test_preemption_matches_hf():
    path = tiny_model_dir("mistral")
    prompts = _prompts(5, [30, 31, 29, 17, 40, 12])
    max_tokens = 24
    # 10 usable blocks of 16 tokens cannot hold six sequences of up to 64 tokens at once.
    llm = LLM(model=str(path), num_kv_blocks=11, max_num_batched_tokens=64)
    outs = tandem_greedy(llm, prompts, max_tokens=max_tokens)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, max_tokens)
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


def test_parallel_sampling_n_greedy_matches_hf():
    path = tiny_model_dir("llama")
    prompts = _prompts(6, [20, 7])  # 20 tokens: the fork shares a partial second block
    llm = LLM(model=str(path), num_kv_blocks=64)
    outs = tandem_greedy(llm, prompts, n=3)
    expected = hf_greedy(path, prompts)
    for out, want in zip(outs, expected):
        assert [c.token_ids for c in out.outputs] == [want] * 3
        assert [c.index for c in out.outputs] == [0, 1, 2]
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


def test_engine_frees_every_block_and_rejects_impossible_requests():
    path = tiny_model_dir("llama")
    llm = LLM(model=str(path), num_kv_blocks=5)  # 4 usable blocks: max_model_len becomes 64
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="context length"):
        llm.generate([_prompts(7, [60])[0]], SamplingParams(max_tokens=40))
    # 20 + 12 tokens fit one sequence (2 blocks), but not three sequences (2 + 2 * 2 blocks).
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([_prompts(7, [20])[0]], SamplingParams(max_tokens=12, n=3))
    out = llm.generate([_prompts(8, [10])[0]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) <= 5
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
