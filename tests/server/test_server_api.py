"""The OpenAI routes through a real uvicorn, with httpx and the official ``openai`` client.

Oracles: the offline ``tandem.LLM`` for outputs (same checkpoint, settings and seed), HF
transformers for logprobs (log_softmax of its forward pass) and for tokenization and the chat
template (``AutoTokenizer``), and hand-computed usage and text offsets."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from tandem import SamplingParams

PROMPTS = ["def main():", "import os\nimport sys"]
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Print hello."}]


def _hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def test_models_health_and_openapi(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].max_model_len == 512  # the tiny model's max_position_embeddings
    assert http.get("/health").json() == {"status": "ready"}
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/health",
            "/metrics", "/tokenize", "/detokenize", "/version"} <= set(paths)


def test_completions_greedy_equal_offline(client, offline, hf_tokenizer):
    want = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    got = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0.0)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.outputs[0].text for w in want]
    assert [c.finish_reason for c in got.choices] == [w.outputs[0].finish_reason for w in want]
    prompt_tokens = sum(len(hf_tokenizer(p)["input_ids"]) for p in PROMPTS)
    completion_tokens = sum(len(w.outputs[0].token_ids) for w in want)
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.completion_tokens == completion_tokens
    assert got.usage.total_tokens == prompt_tokens + completion_tokens


def test_completions_seeded_n2_on_token_ids_equal_offline(client, offline, hf_tokenizer):
    prompts = [hf_tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.9, top_k=20, seed=11, n=2, max_tokens=10)
    want = offline.generate(prompts, params)
    got = client.completions.create(model="tiny", prompt=prompts, n=2, seed=11, temperature=0.9,
                                    max_tokens=10, extra_body={"top_k": 20})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [o.text for w in want for o in w.outputs]
    assert got.usage.prompt_tokens == sum(map(len, prompts))
    assert got.usage.completion_tokens == sum(len(o.token_ids) for w in want for o in w.outputs)


def test_completion_logprobs_match_hf(http, hf, hf_tokenizer):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 3}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    prompt_ids = hf_tokenizer(PROMPTS[0])["input_ids"]
    generated = []
    for i, token in enumerate(lp["tokens"]):
        dist = _hf_logprobs(hf, prompt_ids + generated)[-1]
        token_id = int(dist.argmax())
        assert token == hf_tokenizer.decode([token_id])
        assert lp["token_logprobs"][i] == pytest.approx(float(dist[token_id]), abs=1e-3)
        top = lp["top_logprobs"][i]
        assert len(top) == 3
        assert sorted(top.values(), reverse=True) == pytest.approx(
            [float(v) for v in dist.topk(3).values], abs=1e-3)
        generated.append(token_id)
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets


def test_completion_echo_includes_prompt_and_its_logprobs(http, hf, hf_tokenizer):
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "echo": True}
    out = http.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    prompt_ids = hf_tokenizer(PROMPTS[1])["input_ids"]
    assert choice["text"].startswith(PROMPTS[1]) and len(choice["text"]) > len(PROMPTS[1])
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt_ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _hf_logprobs(hf, prompt_ids)
    for pos in range(1, len(prompt_ids)):
        assert lp["token_logprobs"][pos] == pytest.approx(float(ref[pos - 1, prompt_ids[pos]]), abs=1e-3)
    assert out["usage"]["prompt_tokens"] == len(prompt_ids)
    assert out["usage"]["completion_tokens"] == 3


def test_completion_stop_string_equals_offline(client, offline):
    full = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    stop = full[5:8]
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                    stop=[stop]).choices[0]
    assert got.text == want.outputs[0].text == full[:full.index(stop)]
    assert got.finish_reason == "stop"


def test_completion_stream_equals_offline(client, http, offline):
    # long enough that the answer cannot be complete before the server writes its first chunk
    # (it sends whatever tokens are ready when it writes: a short answer from the tiny model on
    # a fast machine may come in one)
    want = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=300,
                                                       ignore_eos=True))[0].outputs[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=300,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want.text
    assert sum(1 for t in texts if t) > 1, "the text arrives in pieces"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4,
                                                      "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_completion_stream_n2_logprobs(http, offline):
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=8, logprobs=1)
    want = offline.generate(PROMPTS[1], params)[0]
    body = {"prompt": PROMPTS[1], "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 8,
            "logprobs": 1, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = [json.loads(e) for e in _sse_events(response)[:-1]]
    for index in (0, 1):
        parts = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert "".join(p["text"] for p in parts) == want.outputs[index].text
        tokens = [t for p in parts for t in p["logprobs"]["tokens"]]
        logprobs = [v for p in parts for v in p["logprobs"]["token_logprobs"]]
        assert len(tokens) == len(want.outputs[index].token_ids)
        expected = [d[t].logprob for t, d in zip(want.outputs[index].token_ids, want.outputs[index].logprobs)]
        assert logprobs == pytest.approx(expected, abs=1e-5)


def _chat_prompt(hf_tokenizer) -> list[int]:
    return hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_chat_equals_offline(client, offline, hf_tokenizer):
    prompt = _chat_prompt(hf_tokenizer)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         max_completion_tokens=10)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(want.token_ids)
    legacy = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=10)
    assert legacy.choices[0].message.content == want.text


def test_chat_stream_role_first_and_n2(client, offline, hf_tokenizer):
    prompt = _chat_prompt(hf_tokenizer)
    want = offline.generate(prompt, SamplingParams(temperature=0.7, seed=2, n=2, max_tokens=12))[0]
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.7,
                                                 seed=2, n=2, max_tokens=12, stream=True))
    for index in (0, 1):
        deltas = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert deltas[0].delta.role == "assistant" and not deltas[0].delta.content
        assert "".join(d.delta.content or "" for d in deltas) == want.outputs[index].text
        assert deltas[-1].finish_reason == want.outputs[index].finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])


def test_chat_logprobs(client, offline, hf_tokenizer):
    prompt = _chat_prompt(hf_tokenizer)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logprobs=2))[0].outputs[0]
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=5,
                                         logprobs=True, top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for entry, token_id, dist in zip(content, want.token_ids, want.logprobs):
        assert entry.token == hf_tokenizer.decode([token_id])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(dist[token_id].logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy


def _long_unique_prompt(tag: str, hf_tokenizer) -> str:
    """A prompt of more than 3 blocks (block size 16) that no other test sends."""
    prompt = f"# {tag}\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(12))
    assert len(hf_tokenizer.encode(prompt)) > 3 * 16
    return prompt


@pytest.mark.parametrize("stream", [False, True])
def test_completion_usage_reports_prefix_cache_hits(client, hf_tokenizer, stream):
    prompt = _long_unique_prompt(f"cached completion {stream}", hf_tokenizer)
    num_prompt = len(hf_tokenizer.encode(prompt))

    _check_cached_tokens(lambda **kw: client.completions.create(model="tiny", prompt=prompt, **kw),
                         num_prompt, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_usage_reports_prefix_cache_hits(client, hf_tokenizer, stream):
    messages = [{"role": "user", "content": _long_unique_prompt(f"cached chat {stream}", hf_tokenizer)}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    num_prompt = len(hf_tokenizer.encode(text, add_special_tokens=False))

    _check_cached_tokens(lambda **kw: client.chat.completions.create(model="tiny", messages=messages, **kw),
                         num_prompt, stream)


def _check_cached_tokens(create, num_prompt: int, stream: bool) -> None:
    """The first answer to a new prompt reports no cached tokens; the same prompt again reports
    its whole blocks from the prefix cache (at least 2 of 16 tokens, never the last token)."""

    def cached_tokens() -> int:
        kwargs = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        got = create(max_tokens=2, temperature=0.0, **kwargs)
        usage = list(got)[-1].usage if stream else got.usage
        assert usage.prompt_tokens == num_prompt
        return usage.prompt_tokens_details.cached_tokens

    assert cached_tokens() == 0
    second = cached_tokens()
    assert 32 <= second < num_prompt and second % 16 == 0


def test_version(http):
    import tandem

    assert http.get("/version").json() == {"version": tandem.__version__}


def test_models_retrieve_equals_the_listed_model(client):
    listed = client.models.list().data[0]
    got = client.models.retrieve("tiny")
    assert got.model_dump(exclude={"created"}) == listed.model_dump(exclude={"created"})
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other/model")
    assert info.value.body["code"] == "model_not_found"
