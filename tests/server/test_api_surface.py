"""vLLM's request fields beyond OpenAI's sampling through a real uvicorn and the official
``openai`` client: logit_bias, allowed_token_ids, bad_words, prompt_logprobs, and echo with
max_tokens 0 (lm-evaluation-harness's log-likelihood request).

Oracles: HF transformers — ``generate`` with its own processors (sequence_bias,
prefix_allowed_tokens_fn, bad_words_ids) for greedy texts, log_softmax of its forward pass for
logprobs, ``AutoTokenizer`` for tokenization and the chat template."""
from __future__ import annotations

import openai
import pytest
import torch


PROMPT = "def main():\n    return"
MESSAGES = [{"role": "user", "content": "Print hello."}]
N = 8  # tokens generated, min_tokens as well: HF's min_new_tokens masks EOS the same way


def hf_text(hf, tokenizer, prompt_ids: list[int], **processors) -> str:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
                          do_sample=False, **processors)
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """Row i is the distribution of token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def complete(client, **fields) -> openai.types.Completion:
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                     extra_body={"min_tokens": N, **fields.pop("extra", {})}, **fields)


def chat(client, **extra):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N, temperature=0,
                                          extra_body={"min_tokens": N, **extra})


def test_logit_bias_bans_and_forces_tokens_as_hf(client, hf, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    ranked = hf_logprobs(hf, prompt_ids)[-1].argsort(descending=True).tolist()
    first, forced = ranked[0], ranked[5]
    assert complete(client).choices[0].text == hf_text(hf, hf_tokenizer, prompt_ids)
    banned = complete(client, logit_bias={str(first): -100})
    assert banned.choices[0].text == hf_text(hf, hf_tokenizer, prompt_ids, sequence_bias={(first,): -100.0})
    assert not banned.choices[0].text.startswith(hf_tokenizer.decode([first]))
    pushed = complete(client, logit_bias={str(forced): 100})
    assert pushed.choices[0].text == hf_text(hf, hf_tokenizer, prompt_ids, sequence_bias={(forced,): 100.0})
    assert pushed.choices[0].text.startswith(hf_tokenizer.decode([forced]))


def test_chat_logit_bias_as_hf(client, hf, hf_tokenizer):
    prompt_ids = chat_ids(hf_tokenizer)
    first = int(hf_logprobs(hf, prompt_ids)[-1].argmax())
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=N, temperature=0,
                                         logit_bias={str(first): -100}, extra_body={"min_tokens": N})
    want = hf_text(hf, hf_tokenizer, prompt_ids, sequence_bias={(first,): -100.0})
    assert got.choices[0].message.content == want


def test_allowed_token_ids_as_hf(client, hf, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    allowed = sorted(hf_logprobs(hf, prompt_ids)[-1].argsort()[:6].tolist())  # unlikely ones
    choice = complete(client, logprobs=0, extra={"allowed_token_ids": allowed}).choices[0]
    assert choice.text == hf_text(hf, hf_tokenizer, prompt_ids, prefix_allowed_tokens_fn=lambda b, ids: allowed)
    assert len(choice.logprobs.tokens) == N
    assert set(choice.logprobs.tokens) <= {hf_tokenizer.decode([t]) for t in allowed}


def test_bad_words_never_appear_as_hf(client, hf, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    free = complete(client).choices[0].text
    word = next(w for w in free.split() if w)  # a word the model writes greedily
    variants = [hf_tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    got = complete(client, extra={"bad_words": [word]}).choices[0].text
    assert word not in got
    assert got == hf_text(hf, hf_tokenizer, prompt_ids, bad_words_ids=variants)
    in_chat = chat(client, bad_words=[word]).choices[0].message.content
    assert in_chat == hf_text(hf, hf_tokenizer, chat_ids(hf_tokenizer), bad_words_ids=variants)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_with_max_tokens_0_is_the_prompts_log_likelihood(client, hf, hf_tokenizer, stream):
    """lm-evaluation-harness's request: the prompt's tokens and logprobs, nothing generated."""
    prompt_ids = hf_tokenizer.encode(PROMPT)
    ref = hf_logprobs(hf, prompt_ids)
    request = dict(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, **request))
        (choice,) = [c for chunk in chunks for c in chunk.choices]
    else:
        out = client.completions.create(**request)
        (choice,) = out.choices
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), 0)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [hf_tokenizer.decode([t]) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for pos in range(1, len(prompt_ids)):
        assert lp.token_logprobs[pos] == pytest.approx(float(ref[pos - 1, prompt_ids[pos]]), abs=1e-4)
        top = ref[pos - 1].topk(2)
        assert {hf_tokenizer.decode([t]) for t in top.indices.tolist()} <= set(lp.top_logprobs[pos])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_prompt_logprobs_in_vllms_shape(client, hf, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    ref = hf_logprobs(hf, prompt_ids)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0,
                                    extra_body={"prompt_logprobs": 3})
    entries = out.choices[0].prompt_logprobs
    assert out.choices[0].logprobs is None
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for pos in range(1, len(prompt_ids)):
        row, token = ref[pos - 1], prompt_ids[pos]
        entry = entries[pos]
        assert set(entry) >= {str(t) for t in row.topk(3).indices.tolist()} | {str(token)}
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert entry[str(token)]["decoded_token"] == hf_tokenizer.decode([token])


def test_chat_prompt_logprobs_cover_the_rendered_conversation(client, hf, hf_tokenizer):
    prompt_ids = chat_ids(hf_tokenizer)
    ref = hf_logprobs(hf, prompt_ids)
    out = chat(client, prompt_logprobs=0)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for pos in range(1, len(prompt_ids)):
        got = entries[pos][str(prompt_ids[pos])]["logprob"]
        assert got == pytest.approx(float(ref[pos - 1, prompt_ids[pos]]), abs=1e-4)
