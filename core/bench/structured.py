"""`tandem bench structured`: constrained (a cached JSON schema) vs unconstrained decoding, in one run.

The same engine serves both: ``--num-requests`` requests (32 by default) added at once, so they
decode as one batch, with the same prompts and each exactly ``--output-len`` tokens. The
unconstrained requests ignore EOS; the constrained ones follow a JSON schema that no output within
the limit can complete (``schema``), so both runs generate the same tokens per request. Rounds alternate, constrained first;
the median round of each counts. Before the rounds a warm-up of each compiles the schema, so the
timed constrained rounds hit the compile cache — what a service with a fixed schema sees. The
first compile (backend start-up on the vocabulary excluded) is reported apart, as is the time
the engine spent filling bitmasks per step.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

def schema(output_len: int) -> dict:
    """A JSON schema no output shorter than ``output_len`` tokens can complete: an object holding
    an array of at least ``4 * output_len`` strings (each at least 3 characters with its comma)."""
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "items": {"type": "array", "items": {"type": "string"}, "minItems": 4 * output_len},
        },
        "required": ["title", "items"],
        "additionalProperties": False,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF folder (default: the bench-100m preset, built on first use)")
    p.add_argument("--num-requests", type=int, default=32, help="requests decoding at once")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each (the median counts)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    import torch

    from tandem import LLM, SamplingParams

    path = args.model
    if path is None:
        from tandem.models.presets import default_model_path

        path = str(default_model_path("bench-100m"))
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=path, dtype=args.dtype, max_num_seqs=max(args.num_requests, 1),
              max_num_batched_tokens=max(2048, args.num_requests * args.prompt_len))
    engine = llm.engine
    rng = random.Random(args.seed)
    special = set(engine.eos_token_ids) | set(getattr(engine.tokenizer, "all_special_ids", ()))
    ordinary = [t for t in range(len(engine.tokenizer)) if t not in special]
    prompts = [[rng.choice(ordinary) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    n = args.output_len
    plain = SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=n, structured_outputs={"json": schema(n)})

    engine.structured.backend  # the backend reads the vocabulary once, on first use: not a compile
    t0 = time.perf_counter()
    engine.structured.submit(constrained.structured_outputs).future.result()
    first_compile_s = time.perf_counter() - t0
    print(f"model {path}: {args.num_requests} requests at once, prompts {args.prompt_len}, outputs {n} "
          f"tokens, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(f"first compile of the JSON schema: {first_compile_s * 1e3:.1f} ms")

    def one_round(params: SamplingParams) -> tuple[float, int, float, int]:
        fill = _FillTimer(engine)
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t
        fill.stop()
        return seconds, sum(len(o.outputs[0].token_ids) for o in outs), fill.seconds, fill.steps

    one_round(plain), one_round(constrained)  # warm-up
    results: dict[str, list[tuple[float, int, float, int]]] = {"unconstrained": [], "json schema": []}
    for _ in range(args.rounds):
        results["json schema"].append(one_round(constrained))
        results["unconstrained"].append(one_round(plain))
    rates = {}
    for name, rounds in results.items():
        rates[name] = statistics.median(tokens / seconds for seconds, tokens, _, _ in rounds)
        fill_ms = statistics.median(f / max(s, 1) * 1e3 for _, _, f, s in rounds)
        tokens = statistics.median(t for _, t, _, _ in rounds)
        print(f"  {name:<14} {rates[name]:8.1f} tok/s  ({tokens:.0f} tokens per round; bitmask "
              f"{fill_ms:.2f} ms per step)")
    ratio = rates["json schema"] / rates["unconstrained"]
    print(f"constrained / unconstrained throughput: {ratio:.3f} ({(1 - ratio) * 100:+.1f}% loss; "
          f"target <= 5%)")
    engine.close()
    return 0


class _FillTimer:
    """Times the engine's bitmask fills (``StructuredOutputManager.bitmask``) while it lives."""

    def __init__(self, engine) -> None:
        self.manager = engine.structured
        self.original = self.manager.bitmask
        self.seconds, self.steps = 0.0, 0

        def timed(out):
            t = time.perf_counter()
            try:
                return self.original(out)
            finally:
                self.seconds += time.perf_counter() - t
                self.steps += 1

        self.manager.bitmask = timed

    def stop(self) -> None:
        del self.manager.bitmask
