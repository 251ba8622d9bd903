"""The benchmarks' workload runner (tandem.bench.workload): a repeated run of the same workload
in one process computes every prompt again when asked for a cold run — as the peer's fresh
process does — instead of finding the prompts in the prefix cache. Oracle: the tokens the engine
reports computing per step against the prompts' and outputs' lengths, counted by hand (a prompt
token's KV is computed once, an output token's is fed back but for the last; a cached prompt
keeps its whole blocks but the one holding its last token, which is computed again)."""
from __future__ import annotations

from tandem import LLM
from tandem.bench.workload import make_workload, run_tandem
from tests.helpers.tiny_models import tiny_model_dir


def test_a_cold_repeat_computes_every_prompt_again_and_a_warm_one_finds_them_cached():
    llm = LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=256)
    try:
        wl = make_workload(6, (40, 70), (3, 5), llm.engine.arch.vocab_size, set(), 1)
        cold_tokens = sum(len(p) + m - 1 for p, m in zip(wl.prompts, wl.max_tokens))

        def computed(result) -> int:
            return sum(s.stats.num_tokens for s in result.steps)

        first = run_tandem(llm, wl)
        assert computed(first) == cold_tokens
        cold = run_tandem(llm, wl, cold=True)
        assert computed(cold) == cold_tokens
        assert cold.outputs == first.outputs
        warm = run_tandem(llm, wl)  # every whole block of each prompt is cached now
        assert computed(warm) == cold_tokens - sum((len(p) - 1) // 16 * 16 for p in wl.prompts)
    finally:
        llm.engine.close()
