"""Trained GGUF checkpoints from the package registry (tandem.models.registry_weights):
SmolLM2-135M-Instruct (Q4_1, llama, chat template in the metadata) and Gemma 3 270M (Q4_K_M
with Q5_0/Q6_K/Q8_0 tensors, sliding-window layers). Each is loaded once per module by tandem;
transformers (``from_pretrained(folder, gguf_file=name)``, float32) is the oracle, whose answers
are kept per machine (tests.helpers.oracle_cache: its GGUF parse of the vocabulary takes a minute
or more); greedy tokens must be identical."""
from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem import SamplingParams
from tandem.models.gguf_file import read_gguf
from tests.helpers.gguf_files import dense_trained_llm, registry_gguf
from tests.helpers.oracle_cache import oracle_answer

QUESTIONS = ["What is the capital of France?", "Name a primary colour."]
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


@functools.cache
def _hf(path):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module", autouse=True)
def _free_the_oracles():
    """The oracle models (loaded on a cache miss only) live as long as this module's tests."""
    yield
    _hf.cache_clear()


def _hf_greedy(model, prompt: list[int], eos: set[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
    return out[0, len(prompt):].tolist()


def _hf_chat_prompt(path, question: str) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return list(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


@pytest.fixture(scope="module")
def smollm2():
    path = registry_gguf("smollm2-135m-instruct")
    llm = dense_trained_llm("smollm2-135m-instruct")
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], GREEDY)
    return path, llm, outs


def test_smollm2_answers_like_transformers(smollm2):
    path, llm, outs = smollm2
    eos = sorted(llm.engine.eos_token_ids)
    for question, out in zip(QUESTIONS, outs):
        prompt = oracle_answer(path, {"chat_prompt": question}, lambda: _hf_chat_prompt(path, question))
        assert out.prompt_token_ids == prompt
        want = oracle_answer(path, {"greedy": prompt, "new_tokens": NEW_TOKENS, "eos": eos},
                             lambda: _hf_greedy(_hf(path), prompt, set(eos)))
        assert out.outputs[0].token_ids == want
    assert "Paris" in outs[0].outputs[0].text


def test_smollm2_chat_template_and_special_tokens_come_from_the_metadata(smollm2):
    path, llm, _ = smollm2
    meta = read_gguf(path).metadata
    tok = llm.get_tokenizer()
    assert tok.chat_template == meta["tokenizer.chat_template"]
    assert llm.engine.eos_token_ids == {meta["tokenizer.ggml.eos_token_id"]}
    assert tok.convert_tokens_to_ids(tok.eos_token) == meta["tokenizer.ggml.eos_token_id"]
    assert llm.engine.arch.num_key_value_heads == 3 and llm.engine.arch.tie_word_embeddings


@pytest.fixture(scope="module")
def gemma3():
    return registry_gguf("gemma3-270m"), dense_trained_llm("gemma3-270m")


def test_gemma3_continues_like_transformers(gemma3):
    path, llm = gemma3
    assert llm.engine.arch.layer_types.count("full_attention") == 3  # of 18: every 6th layer
    out = llm.generate(["The capital of France is"], GREEDY)[0]
    layer_types = oracle_answer(path, {"layer_types": True}, lambda: list(_hf(path).config.layer_types))
    assert tuple(layer_types) == llm.engine.arch.layer_types
    prompt, eos = list(out.prompt_token_ids), sorted(llm.engine.eos_token_ids)
    want = oracle_answer(path, {"greedy": prompt, "new_tokens": NEW_TOKENS, "eos": eos},
                         lambda: _hf_greedy(_hf(path), prompt, set(eos)))
    assert out.outputs[0].token_ids == want
    assert "France" in out.outputs[0].text  # a base model: it continues, on topic


CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
            ("Norway", "Oslo"), ("Chile", "Santiago"), ("Greece", "Athens"), ("Cuba", "Havana")]


def test_gemma3_past_its_sliding_window_continues_like_transformers(gemma3):
    """A prompt longer than the local layers' window: their attention must drop what lies
    behind it while the global layers keep it, as transformers' Gemma 3 does."""
    path, llm = gemma3
    window = llm.engine.arch.sliding_window
    facts = [f"Fact {i}: the capital of {country} is {city}." for i, (country, city) in
             enumerate(CAPITALS * 5)]
    out = llm.generate([" ".join(facts) + " Fact 60: the capital of Italy is"], GREEDY)[0]
    prompt, eos = list(out.prompt_token_ids), sorted(llm.engine.eos_token_ids)
    assert window is not None and window < len(prompt) < 48 * 16 - NEW_TOKENS
    want = oracle_answer(path, {"greedy": prompt, "new_tokens": NEW_TOKENS, "eos": eos},
                         lambda: _hf_greedy(_hf(path), prompt, set(eos)))
    assert out.outputs[0].token_ids == want
