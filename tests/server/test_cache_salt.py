"""vLLM's ``cache_salt`` on the shared colocated server (issue 24, point 6): requests with
different salts share no prefix-cache block, so ``usage.prompt_tokens_details.cached_tokens``
tells a tenant nothing about another tenant's prompts. Oracles: hand-computed cached counts (the
full blocks of the prompt but its last token) and the server's own block accounting
(``tandem:prefix_cache_hits``, counted by the KV allocator).
"""
from __future__ import annotations

import httpx
import pytest

from tests.engine.test_greedy_vs_hf import _prompts
from tests.server.server_helpers import scrape

BLOCK = 16
LENGTH = 3 * BLOCK + 5
CACHEABLE = (LENGTH - 1) // BLOCK * BLOCK  # the full blocks before the last prompt token


def complete(server, prompt: list[int], salt: str | None) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    if salt is not None:
        body["cache_salt"] = salt
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def cached_and_hits(server, prompt: list[int], salt: str | None) -> tuple[int, float]:
    """(cached_tokens of the answer, prefix-cache hits the allocator counted for it)."""
    before = scrape(server.url)["tandem:prefix_cache_hits_total"]
    answer = complete(server, prompt, salt)
    hits = scrape(server.url)["tandem:prefix_cache_hits_total"] - before
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"], hits


@pytest.mark.timeout(120)
def test_different_salts_share_no_block_and_the_same_salt_does(server):
    prompt = _prompts(70, [LENGTH])[0]
    assert cached_and_hits(server, prompt, "tenant-a") == (0, 0)
    assert cached_and_hits(server, prompt, "tenant-b") == (0, 0)
    assert cached_and_hits(server, prompt, None) == (0, 0)
    assert cached_and_hits(server, prompt, "tenant-a") == (CACHEABLE, CACHEABLE)
    assert cached_and_hits(server, prompt, "tenant-b") == (CACHEABLE, CACHEABLE)
    assert cached_and_hits(server, prompt, None) == (CACHEABLE, CACHEABLE)
    assert cached_and_hits(server, prompt, "Tenant-a") == (0, 0)


@pytest.mark.timeout(120)
def test_chat_requests_are_salted_too(server):
    chat = {"model": "tiny", "max_tokens": 2, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Salted prefixes stay apart. " * 6}]}

    def cached(salt: str) -> int:
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                            json={**chat, "cache_salt": salt})
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("chat-a") == 0
    assert cached("chat-b") == 0
    assert cached("chat-a") > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"], {"a": 1}, True])
def test_a_malformed_salt_is_a_400_naming_it(server, salt):
    for route, extra in [("completions", {"prompt": [5, 6, 7]}),
                         ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        answer = httpx.post(f"{server.url}/v1/{route}", timeout=30,
                            json={"model": "tiny", "max_tokens": 1, "cache_salt": salt, **extra})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "cache_salt"


@pytest.mark.timeout(60)
def test_the_longest_salt_is_accepted(server):
    assert complete(server, [5, 6, 7], "x" * 256)["usage"]["prompt_tokens"] == 3
