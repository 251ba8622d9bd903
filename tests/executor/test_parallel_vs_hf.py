"""Tensor and pipeline parallelism over real worker processes (the "mp" executor, gloo on this
CPU): greedy tokens identical to HF transformers' ``generate`` — the oracle, which runs the whole
model in one process — at tp=2, pp=2 and tp=2 × pp=2, on Llama, Qwen2, Mistral (sliding
window), a single-KV-head model (its head replicated on both ranks), Gemma 3, Phi-3 and Qwen3;
with prefix caching, chunked prefill, forced preemption, n > 1, speculative decoding, a JSON
schema and prompt logprobs running through the same instance."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tandem import LLM, SamplingParams
from tests.engine.test_greedy_vs_hf import MIXED_LENGTHS, _prompts, hf_greedy, tandem_greedy
from tests.engine.test_structured_outputs import PERSON as SCHEMA
from tests.helpers.tiny_models import hf_model, tiny_model_dir, tiny_tokenizer

pytestmark = pytest.mark.timeout(600)


def parallel_llm(kind: str, tp: int, pp: int, **engine) -> LLM:
    engine.setdefault("num_kv_blocks", 128)
    return LLM(model=str(tiny_model_dir(kind)), tensor_parallel_size=tp, pipeline_parallel_size=pp,
               worker_timeout_s=120, **engine)


@pytest.mark.parametrize("kind,tp,pp", [
    ("llama", 2, 1), ("llama_mqa", 2, 1), ("qwen2", 1, 2), ("mistral", 2, 2),
])
def test_greedy_matches_hf_with_prefix_caching_chunks_and_preemption(kind, tp, pp):
    path = tiny_model_dir(kind)
    # 10 usable blocks of 16 tokens cannot hold these sequences at once: the scheduler preempts;
    # a 64-token budget chunks the 70-token prompt.
    llm = parallel_llm(kind, tp, pp, num_kv_blocks=11, max_num_batched_tokens=64)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        prompts = _prompts(1, MIXED_LENGTHS)
        outs = tandem_greedy(llm, prompts, max_tokens=24)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 24)
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0

        shared = _prompts(2, [40])[0]
        tails = _prompts(3, [1, 9, 20])
        first = tandem_greedy(llm, [shared])
        rest = tandem_greedy(llm, [shared + t for t in tails])
        assert all(o.num_cached_tokens >= 32 for o in rest)
        assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(path, [shared] + [shared + t for t in tails])

        forked = tandem_greedy(llm, _prompts(6, [20]), n=2)[0]
        assert [c.token_ids for c in forked.outputs] == hf_greedy(path, _prompts(6, [20])) * 2
        assert llm.engine.scheduler.kv.stats().num_used_blocks == 0
    finally:
        llm.engine.close()


@pytest.mark.parametrize("kind,tp,pp", [("gemma3", 2, 2), ("phi3", 2, 1), ("qwen3", 1, 2), ("granite", 2, 1),
                                         ("smollm3", 1, 2)])
def test_other_architectures_match_hf(kind, tp, pp):
    path = tiny_model_dir(kind)
    llm = parallel_llm(kind, tp, pp)
    try:
        prompts = _prompts(1, MIXED_LENGTHS)
        assert [o.outputs[0].token_ids for o in tandem_greedy(llm, prompts)] == hf_greedy(path, prompts)
    finally:
        llm.engine.close()


def test_speculative_decoding_json_schema_and_prompt_logprobs_at_tp2():
    import torch

    path = tiny_model_dir("llama")
    llm = parallel_llm("llama", 2, 1, num_speculative_tokens=3, speculative_ngram_min=1)
    try:
        prompts = _prompts(1, MIXED_LENGTHS)
        outs = tandem_greedy(llm, prompts, max_tokens=30)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 30)
        assert llm.engine.last_step is not None

        # the grammar's bitmask reaches the rank that samples, over both vocabulary shards
        prompt = tiny_tokenizer().encode("Answer in JSON:")
        params = [SamplingParams(temperature=1.0, max_tokens=450, seed=s, structured_outputs={"json": SCHEMA})
                  for s in range(8)]
        for out in llm.generate([prompt] * len(params), params):
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)

        # prompt logprobs gathered over both vocabulary shards equal HF's log-softmax
        ids = _prompts(9, [12])[0]
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        with torch.inference_mode():
            logits = hf_model(path)(torch.tensor([ids])).logits[0].float()
        want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor([entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        llm.engine.close()
