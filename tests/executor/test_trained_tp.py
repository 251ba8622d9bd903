"""Tensor parallelism on trained weights: SmolLM2-135M-Instruct (float32) over gloo worker
processes answers two chats with HF transformers' greedy tokens on the same GGUF file
(tests/helpers/trained.py), which are tp=1's (tests/models/test_gguf_trained.py). Its 9 attention
heads split over 3 ranks (tp=2 is refused: 2 does not divide them), one of its 3 KV heads each."""
from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.helpers.trained import NEW_TOKENS, chat_ids, hf_greedy, smollm2_path

pytestmark = pytest.mark.timeout(600)
QUESTIONS = ["What is the capital of France?", "Name three fruits."]


def test_tp3_answers_with_the_tokens_of_one_process():
    llm = LLM(model=str(smollm2_path()), dtype="float32", tensor_parallel_size=3, num_kv_blocks=32,
              worker_timeout_s=120)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    finally:
        llm.engine.close()
    prompts = [chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(p) for p in prompts]
