"""The tokenizer is never shared between the event loop and the engine thread: concurrent use of
one Rust tokenizer can fail with "Already borrowed" (transformers #47085, vllm #40949).

The loop encodes prompts and renders chat templates with its own copy, the engine thread
detokenizes with the engine's; under 64 chat requests with long templates while 64 completions
stream, every answer equals the offline API's (the oracle), token for token."""
from __future__ import annotations

import asyncio
import json

import httpx

from tandem import SamplingParams

MAX_TOKENS = 4


def test_the_loop_and_the_engine_thread_have_their_own_tokenizers(server):
    loop_side, engine_side = server.engine.tokenizer, server.engine._engine.tokenizer
    assert loop_side is not engine_side
    assert loop_side.backend_tokenizer is not engine_side.backend_tokenizer
    text = "def main():\n    return 42"
    assert loop_side.encode(text) == engine_side.encode(text)


def _conversation(i: int) -> list[dict]:
    turns = []
    for j in range(3):
        turns.append({"role": "user", "content": f"question {i}.{j}: " + "why is the sky blue? " * 3})
        turns.append({"role": "assistant", "content": f"answer {i}.{j}: " + "because of scattering. " * 3})
    return turns + [{"role": "user", "content": f"and then {i}?"}]


def test_long_chat_templates_while_others_stream(server, offline):
    tokenizer = offline.get_tokenizer()
    chats = [_conversation(i) for i in range(64)]
    chat_prompts = [tokenizer.encode(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                                     add_special_tokens=False) for c in chats]
    assert 150 < min(len(p) for p in chat_prompts) and max(len(p) for p in chat_prompts) < 500
    texts = [f"def function_{i}(x):\n    return x * {i}" for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    want_chat = [o.outputs[0].text for o in offline.generate(chat_prompts, params)]
    want_text = [o.outputs[0].text for o in offline.generate(texts, params)]

    async def chat(client, messages):
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
            "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    async def stream(client, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    async def run():
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            jobs = [stream(client, t) for t in texts] + [chat(client, c) for c in chats]
            return await asyncio.gather(*jobs)

    got = asyncio.run(run())
    assert got[:64] == want_text
    assert got[64:] == want_chat
