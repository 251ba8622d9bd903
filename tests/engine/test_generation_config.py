"""Sampling defaults from the model folder's generation_config.json in the offline ``LLM``, as
vLLM's ``--generation-config``: taken when no SamplingParams are given, ignored with "vllm",
read from another folder when one is named, and logged at start-up.

The copy of the tiny Llama used here has ``top_k: 1`` and a temperature in its file: sampling
then keeps one token per step, so its output is HF transformers' greedy output (the oracle),
while tandem's own defaults (temperature 1, no top-k) sample something else."""
from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tandem import LLM, SamplingParams
from tests.helpers.tiny_models import hf_model, tiny_model_dir

PROMPT = "def main():\n    return"
GREEDY_FILE = {"temperature": 0.7, "top_k": 1, "top_p": 0.95, "do_sample": True}


def with_generation_config(src, dst, fields: dict):
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, **fields}))
    return dst


@pytest.fixture(scope="module")
def greedy_model(tmp_path_factory):
    return with_generation_config(tiny_model_dir("llama"), tmp_path_factory.mktemp("gen") / "model", GREEDY_FILE)


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def test_the_files_defaults_apply_when_no_params_are_given(greedy_model, caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm = LLM(model=str(greedy_model), num_kv_blocks=64)
    assert any("temperature=0.7, top_p=0.95, top_k=1" in r.getMessage() for r in caplog.records)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.95, 1)
    assert (defaults.min_p, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 1.0, 16)
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    out = llm.generate([prompt_ids])[0].outputs[0]
    want = hf_greedy(greedy_model, prompt_ids, len(out.token_ids))
    assert out.token_ids == want and len(want) > 4
    explicit = llm.generate([prompt_ids], SamplingParams(seed=0, max_tokens=len(want)))[0].outputs[0]
    assert explicit.token_ids != want  # SamplingParams given: its own defaults, as in vLLM


def test_vllm_ignores_the_file(greedy_model):
    llm = LLM(model=str(greedy_model), num_kv_blocks=64, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()


def test_another_folder_supplies_the_defaults(greedy_model, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.3, "min_p": 0.1}))
    llm = LLM(model=str(greedy_model), num_kv_blocks=64, generation_config=str(tmp_path))
    defaults = llm.get_default_sampling_params()
    assert (defaults.repetition_penalty, defaults.min_p, defaults.top_k) == (1.3, 0.1, 0)


def test_a_file_with_values_out_of_range_stops_the_start(tmp_path):
    model = with_generation_config(tiny_model_dir("llama"), tmp_path / "model", {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"model.generation_config \(auto\).*top_p"):
        LLM(model=str(model), num_kv_blocks=64)
