"""The "mp" executor with one rank — the model in a worker process, the engine talking to it over
the pipe — answers as HF transformers' ``generate`` does, on the CPU and (marked ``gpu``,
skipped without one) on CUDA with CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from tandem import LLM
from tests.engine.test_greedy_vs_hf import MIXED_LENGTHS, _prompts, hf_greedy, tandem_greedy
from tests.helpers.tiny_models import tiny_model_dir

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_one_rank_in_a_worker_process_matches_hf(device):
    path = tiny_model_dir("qwen2")
    llm = LLM(model=str(path), device=device, dtype="float32", num_kv_blocks=64,
              distributed_executor_backend="mp", worker_timeout_s=120)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        prompts = _prompts(3, MIXED_LENGTHS)
        assert [o.outputs[0].token_ids for o in tandem_greedy(llm, prompts)] == hf_greedy(path, prompts)
    finally:
        llm.engine.close()
