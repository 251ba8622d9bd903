"""One request that makes the model raise fails alone; the others finish with the output they
would have produced.

Oracles: HF ``generate`` on the same weights (greedy), the same engine run without the poison
request (seeded sampling), and the KV pool's own counts (nothing leaked). The poison is a
test-only model plugin (tests/helpers/poison_plugin.py): tandem's Llama, raising whenever a
forward pass sees ``POISON_TOKEN``.
"""
from __future__ import annotations

import asyncio
import random

import pytest

import tandem
from tandem import LLM, SamplingParams
from tandem.async_engine import AsyncEngine
from tandem.errors import RequestFailed
from tandem.config import load_config
from tandem.engine import MAX_FAILED_STEPS_IN_ROW, LLMEngine
from tandem.errors import EngineDeadError
from tandem.plugins.policies import FCFSPolicy
from tests.engine.test_greedy_vs_hf import hf_greedy
from tests.helpers.poison_plugin import POISON_TOKEN, installed, poison_model_dir
from tests.helpers.tiny_models import tiny_model_dir, tiny_tokenizer

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    special = set(tiny_tokenizer().all_special_ids) | {POISON_TOKEN}
    ordinary = [t for t in range(tiny_tokenizer().vocab_size) if t not in special]
    return [[rng.choice(ordinary) for _ in range(n)] for n in lengths]


CLEAN = _prompts(11, [5, 17, 33, 2, 40, 9, 21])
POISONED = _prompts(12, [23])[0]
POISONED[7] = POISON_TOKEN


@pytest.fixture(scope="module")
def llama_dir():
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def poison_dir(llama_dir, tmp_path_factory):
    return poison_model_dir(llama_dir, tmp_path_factory.mktemp("poison") / "model")


@pytest.fixture(scope="module")
def expected(llama_dir):
    want = hf_greedy(llama_dir, CLEAN, MAX_TOKENS)
    assert all(POISON_TOKEN not in tokens for tokens in want), "the oracle itself meets the poison"
    # the model reads its context: another first token changes what follows (STYLE.md rule 12)
    assert hf_greedy(llama_dir, [[CLEAN[4][1]] + CLEAN[4][1:]], MAX_TOKENS)[0] != want[4]
    return want


def _assert_nothing_held(engine: LLMEngine) -> None:
    assert engine.scheduler.kv.stats().num_used_blocks == 0
    engine.scheduler.kv.check_consistency()
    assert engine.step() == []  # the runner learns of the last finished requests in a step
    runner = engine.executor.worker.runner
    assert not runner.requests and not runner.generators and not engine.outputs.states
    assert engine.scheduler.num_isolated == 0 and not engine.scheduler.has_unfinished_requests()


@pytest.mark.parametrize("batched_tokens", [256, 16], ids=["whole-prompts", "chunked"])
def test_a_poison_request_fails_alone_and_the_others_match_hf(poison_dir, expected, batched_tokens):
    with installed():
        llm = LLM(model=str(poison_dir), num_kv_blocks=64, max_num_batched_tokens=batched_tokens)
        prompts = CLEAN[:3] + [POISONED] + CLEAN[3:]
        outs = llm.generate(prompts, GREEDY)
    poisoned = outs.pop(3)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
    assert poisoned.finished and poisoned.outputs[0].finish_reason == "error"
    assert poisoned.outputs[0].token_ids == []
    assert f"request {poisoned.request_id} failed" in poisoned.error and "poisoned input" in poisoned.error
    _assert_nothing_held(llm.engine)


def test_seeded_and_parallel_samples_are_unchanged_by_a_poison_neighbour(llama_dir, poison_dir):
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.0, n=2, max_tokens=MAX_TOKENS, ignore_eos=True)]
    clean = LLM(model=str(llama_dir), num_kv_blocks=64).generate(CLEAN[:3], params)
    with installed():
        llm = LLM(model=str(poison_dir), num_kv_blocks=64)
        outs = llm.generate(CLEAN[:3] + [POISONED], params + [GREEDY])
    assert outs[3].outputs[0].finish_reason == "error"
    for want, got in zip(clean, outs):
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    _assert_nothing_held(llm.engine)


def test_a_failure_while_post_processing_fails_only_that_request(llama_dir, expected):
    engine = LLMEngine(load_config(overrides={"model.path": str(llama_dir), "num_kv_blocks": 64}))
    process = engine.outputs.process

    def fragile(request, new_token_ids, runner_out):
        if request.request_id == "victim" and request.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")
        return process(request, new_token_ids, runner_out)

    engine.outputs.process = fragile
    for i, prompt in enumerate(CLEAN[:2]):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    engine.add_request(CLEAN[2], GREEDY, request_id="victim")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["victim"].outputs[0].finish_reason == "error"
    assert "UnicodeDecodeError" in finals["victim"].error
    assert [finals[f"r{i}"].outputs[0].token_ids for i in range(2)] == expected[:2]
    _assert_nothing_held(engine)


class _Observers:
    """One observer that raises and one that records: the second must still see everything."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

        class Raising:
            @tandem.hookimpl
            def tandem_request_finished(self, request_id, finish_reason):
                raise RuntimeError("observer bug")

            @tandem.hookimpl
            def tandem_engine_started(self, config):
                raise RuntimeError("observer bug")

        outer = self

        class Recording:
            @tandem.hookimpl
            def tandem_request_finished(self, request_id, finish_reason):
                outer.seen.append((request_id, finish_reason))

        self.plugins = (Raising(), Recording())


def test_observer_hooks_that_raise_are_logged_and_skipped(llama_dir, expected, caplog):
    observers = _Observers()
    with installed(*observers.plugins):
        llm = LLM(model=str(llama_dir), num_kv_blocks=64)
        outs = llm.generate(CLEAN[:3], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]
    assert sorted(observers.seen) == [(o.request_id, "length") for o in outs]
    assert "observer bug" in caplog.text and "tandem_request_finished" in caplog.text


def test_an_engine_whose_every_step_fails_gives_up_after_a_bounded_number(llama_dir, tmp_path):
    broken = poison_model_dir(llama_dir, tmp_path / "broken", "BrokenLlamaForCausalLM")
    with installed():
        engine = LLMEngine(load_config(overrides={"model.path": str(broken), "num_kv_blocks": 64}))
    for i, prompt in enumerate(CLEAN):
        engine.add_request(prompt, GREEDY, request_id=f"r{i}")
    failed = []
    with pytest.raises(EngineDeadError, match=f"{MAX_FAILED_STEPS_IN_ROW} engine steps failed in a row"):
        for _ in range(100):
            failed += [o.request_id for o in engine.step() if o.outputs[0].finish_reason == "error"]
    # step 1: the batch of 7 fails (isolated); steps 2..7: one request fails alone each; step 8
    # fails too, and that is the limit
    assert len(failed) == MAX_FAILED_STEPS_IN_ROW - 2


def test_an_inconsistent_kv_pool_after_a_failure_is_fatal(poison_dir):
    with installed():
        engine = LLMEngine(load_config(overrides={"model.path": str(poison_dir), "num_kv_blocks": 64}))

    def corrupt() -> None:
        raise AssertionError("block 3 has ref_count 2 but 1 holders")

    engine.scheduler.kv.check_consistency = corrupt
    engine.add_request(POISONED, GREEDY)
    with pytest.raises(EngineDeadError, match="KV pool is inconsistent.*block 3"):
        engine.step()


def test_a_policy_that_raises_for_one_request_fails_only_its_admission(llama_dir, expected):
    class Picky(FCFSPolicy):
        name = "picky-test"

        def sort_key(self, request):
            if request.priority == 13:
                raise KeyError("policy bug")
            return super().sort_key(request)

    class PickyPlugin:
        @tandem.hookimpl
        def tandem_register_schedulers(self, register):
            register("picky-test", Picky)

    async def run():
        factory = lambda: LLMEngine(load_config(overrides={  # noqa: E731
            "model.path": str(llama_dir), "num_kv_blocks": 64, "scheduler": "picky-test"}))
        engine = AsyncEngine(factory)
        await engine.start()
        await engine.wait_ready()
        try:
            with pytest.raises(RequestFailed, match="admission.*policy bug"):
                await engine.add_request(CLEAN[0], GREEDY, priority=13)

            async def final(prompt):
                last = None
                async for out in engine.generate(prompt, GREEDY):
                    last = out
                return last

            outs = await asyncio.gather(*(final(p) for p in CLEAN[:2]))
            return outs, engine.is_ready, engine.num_queued_requests
        finally:
            await engine.shutdown()

    with installed(PickyPlugin()):
        outs, ready, queued = asyncio.run(run())
    assert [o.outputs[0].token_ids for o in outs] == expected[:2]
    assert ready and queued == 0
