"""logit_bias, allowed_token_ids and bad_words through the whole offline engine, against HF
transformers' ``generate`` with its own processors (sequence_bias, prefix_allowed_tokens_fn,
bad_words_ids) on the same checkpoint: token-identical greedy outputs."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import hf_model, tiny_model_dir, tiny_tokenizer

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def path():
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(model=str(path), num_kv_blocks=128)


@pytest.fixture(scope="module")
def hf(path):
    return hf_model(path)


def hf_generate(model, prompt: list[int], **processors) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             min_new_tokens=MAX_TOKENS, do_sample=False, **processors)
    return out[0, len(prompt):].tolist()


def greedy(llm: LLM, prompt: list[int], **constraints) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, **constraints)
    return llm.generate([prompt], params)[0].outputs[0].token_ids


def hf_next_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def test_logit_bias_bans_the_greedy_token_and_forces_another(llm, hf):
    prompt = _prompts(41, [12])[0]
    logits = hf_next_logits(hf, prompt)
    first, forced = int(logits.argmax()), int(logits.argsort(descending=True)[7])
    plain = greedy(llm, prompt)
    assert plain == hf_generate(hf, prompt) and plain[0] == first
    banned = greedy(llm, prompt, logit_bias={first: -100.0})
    assert banned[0] != first
    assert banned == hf_generate(hf, prompt, sequence_bias={(first,): -100.0})
    pushed = greedy(llm, prompt, logit_bias={forced: 100.0})
    assert pushed[0] == forced
    assert pushed == hf_generate(hf, prompt, sequence_bias={(forced,): 100.0})


def test_allowed_token_ids_restrict_every_output(llm, hf):
    prompt = _prompts(42, [9])[0]
    logits = hf_next_logits(hf, prompt)
    allowed = sorted(int(t) for t in logits.argsort()[:5])  # the five least likely next tokens
    out = greedy(llm, prompt, allowed_token_ids=allowed)
    assert set(out) <= set(allowed)
    assert out == hf_generate(hf, prompt, prefix_allowed_tokens_fn=lambda batch, ids: allowed)
    sampled = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True,
                                                    allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert len(sampled) == 16 and set(sampled) <= set(allowed)


def test_bad_words_never_appear_in_the_output(llm, hf):
    tok = tiny_tokenizer()
    prompt = tok.encode("def main():\n    return")
    plain = greedy(llm, prompt)
    assert plain == hf_generate(hf, prompt)
    word = next(tok.decode([t]) for t in plain if tok.decode([t]).strip())  # a word the model emits
    ids = {tuple(tok.encode(w, add_special_tokens=False)) for w in (word.lstrip(), " " + word.lstrip())}
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                                bad_words=[word]))[0].outputs[0]
    assert word.strip() not in out.text
    assert out.token_ids == hf_generate(hf, prompt, bad_words_ids=[list(i) for i in ids])


def test_a_two_token_bad_word_bans_only_its_completion(llm, hf):
    prompt = _prompts(43, [10])[0]
    plain = greedy(llm, prompt)
    word = plain[2:4]  # the model's own 3rd and 4th tokens: [a, b] bans b right after a
    out = greedy(llm, prompt, bad_words=["unused"], bad_words_token_ids=[word])
    assert all(out[i:i + 2] != word for i in range(len(out) - 1))
    assert out[:3] == plain[:3] and out[3] != plain[3]
    # HF's processor looks at the prompt too: this prompt does not end with the word's first token.
    assert prompt[-1] != word[0]
    assert out == hf_generate(hf, prompt, bad_words_ids=[word])
