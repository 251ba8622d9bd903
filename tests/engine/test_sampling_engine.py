"""Sampling through the whole engine: seeds, logprobs, stops, limits — against HF or by hand."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import hf_model, tiny_model_dir


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=128)


def _hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    prompts = _prompts(10, [9, 23, 4, 17])
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=14, ignore_eos=True)
    mixed = llm.generate(prompts[1:3] + [prompts[0]] + prompts[3:],
                         [noise, noise, params, noise])[2].outputs[0].token_ids
    assert alone == mixed
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=99, ignore_eos=True)
    assert llm.generate([prompts[0]], other_seed)[0].outputs[0].token_ids != alone


def test_seeded_n_sequences_differ_and_repeat(llm):
    prompt = _prompts(11, [12])[0]
    params = SamplingParams(temperature=1.5, max_tokens=8, seed=7, n=3, ignore_eos=True)
    a = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    b = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_logprobs_match_hf_log_softmax(llm):
    path = tiny_model_dir("llama")
    prompt = _prompts(12, [14])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                ignore_eos=True))[0].outputs[0]
    full = prompt + out.token_ids
    ref = torch.log_softmax(_hf_logits(path, full), dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        top = torch.topk(row, 3)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
        assert entry[top.indices[0].item()].rank == 1
    assert abs(out.cumulative_logprob - sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs))) < 1e-4


def test_prompt_logprobs_match_hf(llm):
    path = tiny_model_dir("llama")
    prompt = _prompts(13, [40])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2,
                                                ignore_eos=True))[0]
    ref = torch.log_softmax(_hf_logits(path, prompt), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[pos][prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4


def test_stop_string_cuts_text_and_ends_generation(llm):
    prompt = _prompts(14, [10])[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert cut.text == text[: text.find(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert len(cut.token_ids) < 16


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    prompt = _prompts(15, [8])[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(ids) == 10
    stop_id = ids[4]
    first = ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_from_generation_config_stops_unless_ignored(tmp_path, llm):
    import json
    import shutil

    prompt = _prompts(16, [6])[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ids = free.outputs[0].token_ids
    eos = ids[5]
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos]
    (path / "generation_config.json").write_text(json.dumps(gen))
    llm_eos = LLM(model=str(path), num_kv_blocks=64)
    stopped = llm_eos.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    hf = hf_model(path)
    with torch.inference_mode():
        t = torch.tensor([prompt])
        want = hf.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=12, do_sample=False,
                           eos_token_id=[eos])[0, len(prompt):].tolist()
    assert stopped.token_ids == want == ids[: ids.index(eos) + 1]
    assert stopped.finish_reason == "stop"
    ignored = llm_eos.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                        ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == ids and ignored.finish_reason == "length"
    late = llm_eos.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                     min_tokens=ids.index(eos) + 2))[0].outputs[0]
    assert eos not in late.token_ids[: ids.index(eos) + 2]
