"""The engine gives the same greedy tokens with the "triton" attention backend as with "torch"
(on the CPU the Triton kernels run under TRITON_INTERPRET=1, set by tests/conftest.py)."""
from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import _prompts
from tests.helpers.tiny_models import tiny_model_dir


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3", "gemma3", "smollm3"])
def test_triton_backend_matches_torch_backend(kind):
    path = str(tiny_model_dir(kind))
    prompts = _prompts(20, [3, 17, 20])  # one block, a block and a bit; mistral's window is 8
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=path, num_kv_blocks=32, attention_backend=backend, max_num_batched_tokens=16)
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got["triton"] == got["torch"]
