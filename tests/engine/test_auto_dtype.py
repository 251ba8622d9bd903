"""With ``model.dtype = "auto"`` a bfloat16 checkpoint runs in bfloat16 on a CPU with native
bfloat16 math, and its greedy tokens match HF ``generate`` on the same bfloat16 weights."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem import LLM
from tandem import device as tdevice
from tests.engine.test_greedy_vs_hf import _prompts, tandem_greedy
from tests.helpers.tiny_models import hf_model, tiny_model_dir, tiny_tokenizer


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    model = hf_model(tiny_model_dir("llama")).to(torch.bfloat16)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_follows_the_checkpoint_and_the_cpu(bf16_checkpoint, native, monkeypatch):
    monkeypatch.setattr(tdevice, "cpu_has_native_bf16", lambda: native)
    llm = LLM(model=str(bf16_checkpoint), num_kv_blocks=64)
    assert llm.engine.dtype == (torch.bfloat16 if native else torch.float32)
    assert llm.engine.executor.worker.kv_cache.dtype == llm.engine.dtype


def test_bf16_greedy_matches_hf_bf16(bf16_checkpoint):
    prompts = _prompts(4, [3, 17, 40])
    llm = LLM(model=str(bf16_checkpoint), num_kv_blocks=64, dtype="bfloat16")
    got = [o.outputs[0].token_ids for o in tandem_greedy(llm, prompts, max_tokens=8)]
    hf = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.bfloat16).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              min_new_tokens=8, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    assert got == expected
