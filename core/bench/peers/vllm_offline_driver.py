"""vLLM's side of ``tandem bench offline --baseline vllm``, run as a file by vLLM's own python.

Usage: ``VLLM_PYTHON vllm_offline_driver.py WORKLOAD.json RESULT.json``. It imports nothing of
tandem (tandem is not installed in vLLM's venv) and only the standard library at module level, so
tandem's side can import it to share the file format. vLLM spawns worker processes, hence the
``__main__`` guard.

Workload file: ``{"model", "dtype", "prompts": [[ids]], "max_tokens": [n], "max_num_seqs",
"max_num_batched_tokens", "seed"}``. Each request runs greedy with ``ignore_eos`` and
``min_tokens = max_tokens``, so it generates exactly the tokens it asked for. Before the timed
``LLM.generate`` an untimed warm-up runs ``warmup_prompts`` for ``WARMUP_TOKENS`` tokens each (the
first batches of new shapes compile: on two cores they took minutes). Result file: ``{"seconds": wall
time of the timed LLM.generate, "load_s": time to build the LLM and warm it up, "outputs": [[ids]],
"env": {the VLLM_* variables in force}}``. The environment defaults are
``vllm_cli.default_env()`` (imported as a sibling file: this file's folder is first on ``sys.path``).
"""
from __future__ import annotations

import json
import sys
import time

WARMUP_TOKENS = 2
WORKLOAD_KEYS = ("model", "dtype", "prompts", "max_tokens", "max_num_seqs", "max_num_batched_tokens",
                 "seed")


def load_workload(path: str) -> dict:
    """The workload file as a dict (``workload_file.load_workload`` with this driver's keys)."""
    try:
        from tandem.bench.peers.workload_file import load_workload as load
    except ImportError:  # under the peer's python: the sibling file
        from workload_file import load_workload as load
    return load(path, WORKLOAD_KEYS)


def warmup_prompts(prompts: list) -> list:
    """The prompts (token-id lists or strings) reversed: the same lengths, hence shapes, but no
    prefix-cache hits later."""
    return [p[::-1] for p in prompts]


def write_result(path: str, seconds: float, load_s: float, outputs: list[list[int]],
                 env: dict[str, str]) -> None:
    with open(path, "w") as f:
        json.dump({"seconds": seconds, "load_s": load_s, "outputs": outputs, "env": env}, f)


def _generate(workload: dict) -> tuple[float, float, list[list[int]]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def greedy(m: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=m, min_tokens=m, ignore_eos=True)

    t0 = time.perf_counter()
    llm = LLM(model=workload["model"], dtype=workload["dtype"], seed=workload["seed"],
              max_num_seqs=workload["max_num_seqs"],
              max_num_batched_tokens=workload["max_num_batched_tokens"])
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warmup_prompts(workload["prompts"])],
                 greedy(WARMUP_TOKENS), use_tqdm=False)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [greedy(m) for m in workload["max_tokens"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, load_s, [list(o.outputs[0].token_ids) for o in outs]


def main(workload_path: str, result_path: str) -> int:
    from vllm_cli import apply_default_env

    env = apply_default_env()
    print("vllm driver: " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    seconds, load_s, outputs = _generate(load_workload(workload_path))
    write_result(result_path, seconds, load_s, outputs, env)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
