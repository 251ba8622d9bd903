"""The offline benchmarks' workload and results (``tandem bench offline``, its parallel run and
its peers): seeded random requests, one mode's outputs and wall time, tandem's run over them, and
how far two modes' outputs agree."""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(slots=True)
class ModeResult:
    mode: str
    seconds: float
    outputs: list[list[int]]
    steps: list = field(default_factory=list)
    """tandem's engine steps (``tandem.bench.roofline.RecordedStep``); empty for the HF modes."""

    def tokens_per_s(self, wl: Workload) -> float:
        return wl.num_output_tokens / self.seconds


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, special_ids: set[int], seed: int) -> Workload:
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab_size) if t not in special_ids]
    prompts = [[rng.choice(ordinary) for _ in range(rng.randint(*prompt_range))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(*output_range) for _ in range(num_requests)]
    return Workload(prompts, max_tokens)


def run_tandem(llm, wl: Workload, cold: bool = False) -> ModeResult:
    """``wl`` through ``llm``; ``cold``: its prefix cache emptied first, so that a repeat of the
    workload computes every prompt again (as a peer's fresh process does) instead of finding
    them cached."""
    from tandem import SamplingParams
    from tandem.bench.roofline import BANDWIDTH_SAMPLE_EVERY, recording_steps

    if cold:
        llm.engine.reset_prefix_cache()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in wl.max_tokens]
    t0 = time.perf_counter()
    with recording_steps(llm.engine, BANDWIDTH_SAMPLE_EVERY) as steps:
        outs = llm.generate(wl.prompts, params)
    seconds = time.perf_counter() - t0 - sum(s.sampling_s for s in steps)
    drafted = sum(s.stats.num_draft_tokens for s in steps)
    accepted = sum(s.stats.num_accepted_draft_tokens for s in steps)
    if drafted:
        print(f"  speculative decoding: {accepted} of {drafted} draft tokens accepted "
              f"({accepted / drafted:.0%})")
    return ModeResult("tandem", seconds, [o.outputs[0].token_ids for o in outs], steps)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose token sequences are identical."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def describe_workload(path: str, wl: Workload, args: argparse.Namespace) -> str:
    return (f"model {path}: {wl.num_output_tokens} output tokens over {len(wl.prompts)} requests, "
            f"prompts {args.prompt_len[0]}-{args.prompt_len[1]}, outputs "
            f"{args.output_len[0]}-{args.output_len[1]}, {args.dtype}")


def token_agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of output tokens equal at the same position of the same request."""
    same = sum(a == b for x, y in zip(ours, theirs) for a, b in zip(x, y))
    return same / max(sum(map(len, ours)), 1)
