"""The offline engine's features on trained weights (SmolLM2-135M-Instruct, float32), against HF
transformers' greedy ``generate`` on the same GGUF file (tests/helpers/trained.py): one engine
with a KV pool too small for its batch (it preempts), a token budget smaller than every prompt
(it chunks them), prefix caching on (the chat template's system prompt is shared) and n-gram
speculative decoding on; each feature is shown to have happened by the engine's own records,
and the tokens still equal HF's."""
from __future__ import annotations

from collections import Counter

import pytest

from tandem import LLM, SamplingParams
from tests.helpers.trained import NEW_TOKENS, chat_ids, hf_greedy, smollm2_path

QUESTIONS = ["What is the capital of France?", "Name three fruits.",
             "Who wrote Romeo and Juliet? Answer in one short sentence.",
             "Why is the sky blue? Explain it to a child in simple words."]
REPEAT = ("Repeat this sentence word for word: the old lighthouse keeper walked down to the harbour "
          "every morning to count the fishing boats.")
REPEAT_TOKENS = 24
"""New tokens of the repeated sentence: enough drafts for an acceptance rate."""
BUDGET = 32
"""max_num_batched_tokens: below every prompt's length, so each prompt is computed in chunks."""
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


class StepRecorder:
    """Wraps the engine's executor and step to count, per step, the requests computing a partial
    prompt chunk (scheduled, nothing sampled) and the drafts checked and accepted."""

    def __init__(self, llm: LLM) -> None:
        self.counts = Counter()
        engine = llm.engine
        execute, step = engine.executor.execute, engine.step

        def recording_execute(sched_out):
            runner_out = execute(sched_out)
            self.counts["partial_chunks"] += len(set(sched_out.num_scheduled_tokens)
                                                 - set(runner_out.sampled_token_ids))
            return runner_out

        def recording_step():
            outputs = step()
            self.counts["drafts"] += engine.last_step.num_draft_tokens
            self.counts["accepted"] += engine.last_step.num_accepted_draft_tokens
            return outputs

        engine.executor.execute, engine.step = recording_execute, recording_step

    def take(self) -> Counter:
        counts, self.counts = self.counts, Counter()
        return counts


@pytest.fixture(scope="module")
def smollm2():
    # 7 usable blocks of 16 tokens: the four 40-50-token prompts and their answers do not fit at once
    llm = LLM(model=str(smollm2_path()), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=BUDGET,
              num_speculative_tokens=4, num_threads=1)
    yield llm, StepRecorder(llm)
    llm.engine.close()


def _chat(llm: LLM, questions: list[str]):
    return llm.chat([[{"role": "user", "content": q}] for q in questions], GREEDY)


def test_single_and_batched_greedy_equal_hf_under_preemption_chunks_and_prefix_caching(smollm2):
    llm, recorder = smollm2
    prompts = [chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert min(map(len, prompts)) > BUDGET, [len(p) for p in prompts]

    single = _chat(llm, QUESTIONS[:1])[0]
    assert single.prompt_token_ids == prompts[0]
    assert single.outputs[0].token_ids == hf_greedy(prompts[0])
    assert "Paris" in single.outputs[0].text
    assert recorder.take()["partial_chunks"] > 0

    batch = _chat(llm, QUESTIONS)
    counts = recorder.take()
    assert [o.prompt_token_ids for o in batch] == prompts
    assert [o.outputs[0].token_ids for o in batch] == [hf_greedy(p) for p in prompts]
    assert sum(o.metrics["num_preemptions"] for o in batch) > 0
    assert counts["partial_chunks"] > 0
    assert batch[0].num_cached_tokens > 0  # the single run's prompt, again
    assert llm.engine.scheduler.kv.stats().num_used_blocks == 0


def test_ngram_drafts_are_accepted_on_repeated_text_and_greedy_is_unchanged(smollm2):
    llm, recorder = smollm2
    prompt = chat_ids([{"role": "user", "content": REPEAT}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=REPEAT_TOKENS))[0]
    counts = recorder.take()
    assert out.outputs[0].token_ids == hf_greedy(prompt, REPEAT_TOKENS)  # HF: greedy without speculation
    rate = counts["accepted"] / counts["drafts"]
    print(f"n-gram acceptance on SmolLM2 repeating its prompt: {counts['accepted']}/{counts['drafts']} "
          f"drafts = {rate:.2f}")
    assert counts["accepted"] > 0
