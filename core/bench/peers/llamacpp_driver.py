"""llama.cpp's side of ``tandem bench offline --baseline llamacpp``, run as a file by the python of
a venv with llama-cpp-python (``scripts/make_llamacpp_venv.sh``).

Usage: ``LLAMACPP_PYTHON llamacpp_driver.py WORKLOAD.json RESULT.json``. It imports nothing of tandem
and only the standard library at module level, so tandem's side imports it to share the format.

Workload file: ``{"model": the .gguf file, "threads", "n_ctx", "prompts": [[ids]], "max_tokens": [n],
"pp_prompt": [ids], "decode_prompt": [ids], "decode_tokens": n, "repeats": r}``. Every generation is greedy
(temperature 0, no repetition penalty) and runs exactly the tokens asked for: EOS is not a stop,
the generator is simply read that far. The binding serves one sequence at a time, so the workload's
requests run one after another, each from an empty context. Before anything is timed, one
untimed warm-up generation. Result file: ``{"seconds": wall time of the requests, "outputs":
[[ids]], "load_s", "version"}`` and, with ``repeats`` > 0, the medians over that many runs of
``"pp_tok_s"`` (len(pp_prompt) / the time to evaluate it from an empty context) and
``"decode_tok_s"`` (decode tokens after the first / their time, at batch 1).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

WORKLOAD_KEYS = ("model", "threads", "n_ctx", "prompts", "max_tokens", "pp_prompt", "decode_prompt",
                 "decode_tokens", "repeats")


def load_workload(path: str) -> dict:
    """The workload file as a dict (``workload_file.load_workload`` with this driver's keys)."""
    try:
        from tandem.bench.peers.workload_file import load_workload as load
    except ImportError:  # under the peer's python: the sibling file
        from workload_file import load_workload as load
    return load(path, WORKLOAD_KEYS)


def greedy(llm, prompt: list[int], n: int, on_first=None) -> list[int]:
    """``n`` greedy tokens after ``prompt``, from an empty context; ``on_first()`` is called
    when the first one is out (the prompt evaluated)."""
    llm.reset()
    out = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if len(out) == 1 and on_first is not None:
            on_first()
        if len(out) == n:
            break
    return out


def run(workload: dict) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=workload["model"], n_ctx=workload["n_ctx"], n_batch=512,
                          n_threads=workload["threads"], n_threads_batch=workload["threads"],
                          seed=0, verbose=False)
    greedy(llm, workload["decode_prompt"], 4)
    load_s = time.perf_counter() - t0

    result = {"load_s": load_s, "version": llama_cpp.__version__}
    if workload["repeats"] > 0:
        result["pp_tok_s"] = statistics.median(_prompt_rate(llm, workload["pp_prompt"])
                                               for _ in range(workload["repeats"]))
        result["decode_tok_s"] = statistics.median(_decode_rate(llm, workload["decode_prompt"], workload["decode_tokens"])
                                                   for _ in range(workload["repeats"]))
    t0 = time.perf_counter()
    outputs = [greedy(llm, p, m) for p, m in zip(workload["prompts"], workload["max_tokens"])]
    return {**result, "seconds": time.perf_counter() - t0, "outputs": outputs}


def _prompt_rate(llm, prompt: list[int]) -> float:
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - t0)


def _decode_rate(llm, prompt: list[int], n: int) -> float:
    first = []
    greedy(llm, prompt, n, lambda: first.append(time.perf_counter()))
    return (n - 1) / (time.perf_counter() - first[0])


def main(workload_path: str, result_path: str) -> int:
    result = run(load_workload(workload_path))
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
