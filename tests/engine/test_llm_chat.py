"""``LLM.chat``: each conversation through the tokenizer's chat template (HF transformers'
``apply_chat_template`` is the oracle of the rendering), then generated as ``LLM.generate`` does
on those token ids."""
from __future__ import annotations

import pytest

from tandem import LLM, SamplingParams
from tests.helpers.tiny_models import tiny_model_dir, tiny_tokenizer

CONVERSATIONS = [
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Print hello."}],
    [{"role": "user", "content": [{"type": "text", "text": "Sort"}, {"type": "text", "text": "a list."}]}],
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=64)


def hf_rendered(conversation, add_generation_prompt=True) -> list[int]:
    turns = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
              else "\n".join(p["text"] for p in m["content"])} for m in conversation]
    text = tiny_tokenizer().apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tiny_tokenizer().encode(text, add_special_tokens=False)


def test_chat_equals_generate_on_the_rendered_prompts(llm):
    got = llm.chat(CONVERSATIONS, PARAMS)
    want = llm.generate([hf_rendered(c) for c in CONVERSATIONS], PARAMS)
    assert [o.prompt_token_ids for o in got] == [hf_rendered(c) for c in CONVERSATIONS]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]


def test_one_conversation_gives_one_output(llm):
    (out,) = llm.chat(CONVERSATIONS[0], PARAMS)
    assert out.prompt_token_ids == hf_rendered(CONVERSATIONS[0])


def test_without_the_generation_prompt(llm):
    (out,) = llm.chat(CONVERSATIONS[0], PARAMS, add_generation_prompt=False)
    assert out.prompt_token_ids == hf_rendered(CONVERSATIONS[0], add_generation_prompt=False)
    assert out.prompt_token_ids != hf_rendered(CONVERSATIONS[0])


@pytest.mark.parametrize("messages", [
    [{"content": "no role"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    ["just a string"],
])
def test_malformed_messages_are_refused(llm, messages):
    with pytest.raises(ValueError):
        llm.chat(messages, PARAMS)
