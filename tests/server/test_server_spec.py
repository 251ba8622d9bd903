"""A server with speculative decoding streams several tokens per step and still answers what the
offline API without it answers (the oracle); its metrics count drafts and acceptances."""
from __future__ import annotations

import openai

from tandem import SamplingParams
from tests.server.server_helpers import running_server, scrape, server_config

PROMPT = "def main():\n    print("


def test_streamed_output_equals_offline_without_drafts(model_dir, offline):
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=48, logprobs=1))[0].outputs[0]
    with running_server(server_config(model_dir, served_model_name="tiny", num_speculative_tokens=4,
                                      speculative_ngram_min=1)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48, temperature=0,
                                                logprobs=1, stream=True, stream_options={"include_usage": True}))
        metrics = scrape(server.url)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want.text
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == len(want.token_ids) == chunks[-1].usage.completion_tokens
    assert all(abs(a - b[t].logprob) < 1e-4 for a, t, b in zip(tokens, want.token_ids, want.logprobs))
    assert metrics["tandem:spec_decode_num_accepted_tokens_total"] > 0
    assert metrics["tandem:spec_decode_num_draft_tokens_total"] >= metrics["tandem:spec_decode_num_accepted_tokens_total"]
