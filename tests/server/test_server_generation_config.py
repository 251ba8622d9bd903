"""The server's sampling defaults from generation_config.json (``--generation-config``): a
request that leaves temperature/top_k/top_p out gets the file's, one that sets them keeps its
own, and ``vllm`` serves tandem's defaults whatever the file says.

The model folder's file has ``top_k: 1``: its defaults sample HF transformers' greedy output
(the oracle); tandem's own (temperature 1, no top-k) sample something else for these seeds."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.engine.test_generation_config import GREEDY_FILE, with_generation_config
from tests.helpers.tiny_models import hf_model
from tests.server.server_helpers import running_server, server_config

PROMPT = "def main():\n    return"
N = 8


@pytest.fixture(scope="module")
def greedy_model(model_dir, tmp_path_factory):
    return with_generation_config(model_dir, tmp_path_factory.mktemp("gen") / "model", GREEDY_FILE)


def hf_greedy(path, tokenizer, prompt_ids: list[int]) -> str:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=N, min_new_tokens=N)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def hf_greedy_text(greedy_model, hf_tokenizer) -> str:
    return hf_greedy(greedy_model, hf_tokenizer, hf_tokenizer.encode(PROMPT))


def texts(url: str, seeds, **fields) -> list[str]:
    out = []
    for seed in seeds:
        body = {"prompt": PROMPT, "max_tokens": N, "min_tokens": N, "seed": seed, **fields}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["text"])
    return out


def test_auto_takes_the_files_defaults_and_explicit_values_win(greedy_model, hf_greedy_text):
    with running_server(server_config(greedy_model)) as srv:
        assert texts(srv.url, range(3)) == [hf_greedy_text] * 3
        explicit = texts(srv.url, range(3), top_k=0, temperature=1.0)
        assert all(text != hf_greedy_text for text in explicit)


def test_vllm_serves_tandems_own_defaults(greedy_model, hf_greedy_text):
    with running_server(server_config(greedy_model, **{"model.generation_config": "vllm"})) as srv:
        assert all(text != hf_greedy_text for text in texts(srv.url, range(3)))
        assert texts(srv.url, [0], top_k=1) == [hf_greedy_text]


def test_chat_takes_the_files_defaults_too(greedy_model, hf_tokenizer):
    messages = [{"role": "user", "content": "Print hello."}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = hf_greedy(greedy_model, hf_tokenizer, hf_tokenizer.encode(text, add_special_tokens=False))
    with running_server(server_config(greedy_model)) as srv:
        body = {"messages": messages, "max_tokens": N, "min_tokens": N, "seed": 1}
        response = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)
        assert response.json()["choices"][0]["message"]["content"] == want
