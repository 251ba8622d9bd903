"""`tandem bench multiturn`'s parts that need no cluster (tandem.bench.multiturn): the
conversations it sends, against a fake router (httpx.MockTransport answering every turn " yes"
as a stream), its summary and its table, and the config files it writes. Oracles: prompts and
character counts written out by hand, percentiles and shares worked out by hand, and tandem's own
config loader for the config files."""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import random
import re

import httpx
import pytest

from tandem.bench import multiturn
from tandem.bench.cluster_io import toml
from tandem.bench.multiturn import SetupResult, Turn
from tandem.bench.netns import Host
from tandem.config import load_config

ANSWER = (" ye", "s")
"""The fake router's answer to every turn, in two stream chunks."""
SECRET = "0123456789abcdef0123456789abcdef"


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    multiturn.add_arguments(parser)
    return parser.parse_args(["--model", "/models/bench", *argv])


class FakeRouter:
    """Records every completion request; answers ANSWER streamed, then the usage chunk (prompt
    tokens: the prompt's characters; 7 cached), or the HTTP status ``fail_with`` on the turns
    numbered in it (in arrival order, from 0)."""

    def __init__(self, fail_with: dict[int, int] | None = None) -> None:
        self.bodies: list[dict] = []
        self.fail_with = fail_with or {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        body = json.loads(request.content)
        self.bodies.append(body)
        if (status := self.fail_with.get(len(self.bodies) - 1)) is not None:
            return httpx.Response(status, json={"error": {"message": "overloaded"}})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 7}}
        chunks = [{"choices": [{"index": 0, "text": text}]} for text in ANSWER] + [{"choices": [], "usage": usage}]
        stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=stream.encode(), headers={"content-type": "text/event-stream"})

    @property
    def prompts(self) -> list[str]:
        return [b["prompt"] for b in self.bodies]


def one_conversation(router: FakeRouter, system: str, args: argparse.Namespace) -> list[Turn]:
    async def talk() -> list[Turn]:
        async with httpx.AsyncClient(base_url="http://router", transport=httpx.MockTransport(router)) as client:
            return await multiturn.conversation(client, system, 0, args)

    return asyncio.run(talk())


def test_words_gives_as_many_words_of_one_to_three_syllables_as_asked_the_same_for_a_seed():
    for count in (1, 7, 300):
        text = multiturn.words(random.Random(5), count)
        assert len(text.split(" ")) == count
        # every syllable is 2 or 3 lowercase letters: a word of 1-3 of them has 2-9
        assert all(re.fullmatch("[a-z]{2,9}", w) for w in text.split(" ")), text
    assert multiturn.words(random.Random(5), 40) == multiturn.words(random.Random(5), 40)
    assert multiturn.words(random.Random(5), 40) != multiturn.words(random.Random(6), 40)


def test_each_turn_is_the_whole_conversation_so_far_with_counts_by_hand(monkeypatch):
    """Words fixed to "ab": system "ab ab ab" (8 characters), user messages "ab ab" (5), answers
    " yes" (4). Turn 0: "ab ab ab\\n" (9, offered: the shared system prompt) + "User: ab ab" (11) +
    "\\nAssistant:" (11) = 31; turn 1: 31 + 4 + "\\n" = 36 offered, 36 + 22 = 58; turn 2: 63
    offered, 85 in all. Offered share: (9 + 36 + 63) / (31 + 58 + 85) = 108 / 174."""
    monkeypatch.setattr(multiturn, "words", lambda rng, count: " ".join(["ab"] * count))
    router = FakeRouter()
    turns = one_conversation(router, "ab ab ab", bench_args("--turns", "3", "--user-words", "2", "--output-len", "5"))
    assert router.prompts == [
        "ab ab ab\nUser: ab ab\nAssistant:",
        "ab ab ab\nUser: ab ab\nAssistant: yes\nUser: ab ab\nAssistant:",
        "ab ab ab\nUser: ab ab\nAssistant: yes\nUser: ab ab\nAssistant: yes\nUser: ab ab\nAssistant:"]
    assert [t.prompt_chars for t in turns] == [31, 58, 85]
    assert [t.offered_chars for t in turns] == [9, 36, 63]
    assert all(b["max_tokens"] == 5 and b["temperature"] == 0.0 and b["ignore_eos"] is True and b["stream"] is True
               and b["stream_options"] == {"include_usage": True} for b in router.bodies)
    # what the usage chunk said, and a first token before the end
    assert [(t.prompt_tokens, t.cached_tokens, t.output_tokens) for t in turns] == [(31, 7, 2), (58, 7, 2), (85, 7, 2)]
    assert all(t.error is None and 0 < t.ttft_s <= t.e2e_s for t in turns)
    summary = multiturn.summarize(SetupResult(turns, wall_s=2.0))
    assert summary["offered_share"] == pytest.approx(108 / 174)
    assert summary["cached_share"] == pytest.approx(21 / 174)
    assert summary["mean_prompt_tokens"] == pytest.approx(58.0)
    assert summary["output_tok_s"] == pytest.approx(3.0)  # 3 turns x 2 tokens in 2 s


def test_users_share_the_system_prompt_and_each_extends_only_their_own_conversation(monkeypatch):
    """3 users x 4 turns through run_workload: 12 requests; every prompt opens with the same
    12-word system prompt; grouped by their first user message, each user's prompts are 4, each
    the previous one plus " yes", a newline and a new 5-word user message."""
    router = FakeRouter()
    with_router = functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(router))
    monkeypatch.setattr(httpx, "AsyncClient", with_router)
    args = bench_args("--users", "3", "--turns", "4", "--system-words", "12", "--user-words", "5", "--seed", "0")
    turns, wall_s = asyncio.run(multiturn.run_workload("http://router", args))
    assert len(turns) == len(router.prompts) == 12 and wall_s > 0
    assert all(t.error is None for t in turns)
    system = router.prompts[0].split("\nUser: ")[0]
    assert len(system.split(" ")) == 12
    assert all(p.startswith(system + "\nUser: ") for p in router.prompts)
    by_user: dict[str, list[str]] = {}
    for prompt in router.prompts:
        by_user.setdefault(prompt[len(system) + len("\nUser: "):].split("\n")[0], []).append(prompt)
    assert sorted(len(p) for p in by_user.values()) == [4, 4, 4]
    message = re.compile(r"User: [a-z]+( [a-z]+){4}\nAssistant:")
    # no user's words repeat the system prompt's (their generators are not its generator)
    assert not any(system.startswith(first) for first in by_user)
    for prompts in by_user.values():
        assert message.fullmatch(prompts[0][len(system) + 1:])
        for before, after in zip(prompts, prompts[1:]):
            assert after.startswith(before + " yes\n") and message.fullmatch(after[len(before) + 5:])


def test_a_failed_turn_is_an_error_and_its_conversation_goes_on(monkeypatch):
    router = FakeRouter(fail_with={1: 503})
    turns = one_conversation(router, "sys", bench_args("--turns", "3", "--user-words", "1"))
    assert len(router.prompts) == 3
    assert turns[1].error.startswith("HTTP 503") and [turns[0].error, turns[2].error] == [None, None]
    summary = multiturn.summarize(SetupResult(turns, wall_s=1.0))
    assert (summary["requests"], summary["errors"]) == (3, 1)
    assert summary["output_tok_s"] == pytest.approx(4.0)  # the two answered turns' 2 tokens each


def test_summary_by_hand():
    """Four answered turns (TTFT 10, 20, 30, 40 ms) and one failed (its numbers ignored).
    p50: halfway between 20 and 30 = 25; p99 (numpy's linear: rank 0.99 x 3 = 2.97) =
    30 + 0.97 x 10 = 39.7. 32 output tokens in 2 s; cached 96 of 200 prompt tokens; offered
    240 of 600 prompt characters."""
    answered = [Turn(ttft_s=ms / 1000, prompt_tokens=50, cached_tokens=cached, output_tokens=8,
                     offered_chars=offered, prompt_chars=chars)
                for ms, cached, offered, chars in [(40, 48, 120, 200), (10, 0, 0, 100), (30, 32, 80, 200),
                                                   (20, 16, 40, 100)]]
    failed = Turn(ttft_s=5.0, prompt_tokens=1000, cached_tokens=1000, output_tokens=100, offered_chars=900,
                  prompt_chars=1000, error="HTTP 500")
    summary = multiturn.summarize(SetupResult([*answered, failed], wall_s=2.0, kv_bytes=4096.0,
                                              paths={"cached_prefix": 3.0}))
    assert summary == {"requests": 5, "errors": 1, "ttft_p50_ms": pytest.approx(25.0),
                       "ttft_p99_ms": pytest.approx(39.7), "output_tok_s": pytest.approx(16.0),
                       "kv_bytes_read": 4096.0, "cached_share": pytest.approx(0.48),
                       "offered_share": pytest.approx(0.4), "mean_prompt_tokens": pytest.approx(50.0),
                       "paths": {"cached_prefix": 3.0}, "wall_s": 2.0}


def test_a_summary_with_every_turn_failed_has_no_latency():
    summary = multiturn.summarize(SetupResult([Turn(error="x"), Turn(error="y")], wall_s=1.0))
    assert (summary["requests"], summary["errors"], summary["output_tok_s"]) == (2, 2, 0.0)
    assert math.isnan(summary["ttft_p50_ms"]) and math.isnan(summary["mean_prompt_tokens"])


def _row(p50_ms: float, p99_ms: float, tok_s: float, kv_mib: float, cached: float, errors: int) -> dict:
    return {"ttft_p50_ms": p50_ms, "ttft_p99_ms": p99_ms, "output_tok_s": tok_s, "kv_bytes_read": kv_mib * 2**20,
            "cached_share": cached, "errors": errors, "offered_share": 0.95, "mean_prompt_tokens": 1060.2,
            "paths": {"cached_prefix": 40.0}}


def test_table_rows_and_the_goal_line():
    report = {"reuse": _row(1520.4, 5300.0, 63.74, 21.0, 0.9, 0),
              "no_reuse": _row(28000.0, 103000.0, 5.8, 800.0, 0.0, 2),
              "colocated": _row(1350.0, 7150.0, 29.4, 0.0, 0.85, 0), "ttft_p50_ratio": 18.5}
    assert multiturn.format_table(report).split("\n") == [
        "| setup | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | KV bytes read | cached share | errors |",
        "|---|---|---|---|---|---|---|",
        "| reuse | 1520 | 5300 | 63.7 | 21.0 MiB | 90% | 0 |",
        "| no_reuse | 28000 | 103000 | 5.8 | 800.0 MiB | 0% | 2 |",
        "| colocated | 1350 | 7150 | 29.4 | 0.0 MiB | 85% | 0 |",
        "",
        "prefix the workload offers: 95% of prompt characters; mean prompt 1060 tokens",
        "TTFT p50 no_reuse / reuse: 18.50x (goal 3x: met); dispatch paths (reuse): {'cached_prefix': 40.0}"]
    assert "(goal 3x: met)" in multiturn.format_table({**report, "ttft_p50_ratio": 3.0})
    assert "(goal 3x: NOT met)" in multiturn.format_table({**report, "ttft_p50_ratio": 2.99})


@pytest.mark.parametrize("setup, caching, events, decode_policy, min_uncached", [
    ("reuse", True, True, "cache_aware", 256),
    ("no_reuse", False, False, "least_loaded", 0),
    ("colocated", True, False, "round_robin", 0)])
def test_config_files_load_as_the_setup_says(tmp_path, setup, caching, events, decode_policy, min_uncached):
    """The files the bench writes, read back by tandem's config loader (which rejects unknown
    keys): the module docstring's three setups."""
    args = bench_args("--users", "5")
    host = Host(1, "tandem-test-1", "10.0.0.2")
    role = "both" if setup == "colocated" else "decode"
    (tmp_path / "instance.toml").write_text(toml(multiturn.instance_config(setup, role, host, args, SECRET)))
    instance = load_config(tmp_path / "instance.toml", env={}, check_plugins=False)
    assert (instance.engine.enable_prefix_caching, instance.kv_events.enabled) == (caching, events)
    assert (instance.server.host, instance.server.port, instance.engine.max_num_seqs) == ("10.0.0.2", 8000, 5)
    assert (instance.disaggregation.role, instance.disaggregation.kv_connector) == (role, "nixl")
    if events:
        assert instance.kv_events.endpoint == "tcp://10.0.0.2:5557"
    listed = [("http://10.0.0.1:8000", "prefill"), ("http://10.0.0.2:8000", "decode")]
    (tmp_path / "router.toml").write_text(toml(multiturn.router_config(setup, listed, 9100, args, SECRET)))
    router = load_config(tmp_path / "router.toml", env={}, check_plugins=False).disaggregation
    assert (router.routing_policy, router.decode_routing_policy) == ("round_robin", decode_policy)
    assert router.min_uncached_prefill_tokens == min_uncached
    assert [(i.url, i.role) for i in router.instances] == listed
