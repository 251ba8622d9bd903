"""llama.cpp as a baseline of ``tandem bench offline``, measured in the same run (``--baseline
llamacpp``), on the same GGUF file.

llama-cpp-python lives in a venv of its own (``scripts/make_llamacpp_venv.sh``), given by
``--llamacpp-python``; its side is ``llamacpp_driver.py``, run as a file by that python with a JSON
workload (the same prompt token ids and output lengths tandem gets). Two comparisons:

- the workload: tandem's ``LLM.generate`` over all requests at once against llama.cpp serving them
  one after another (the binding has no batching across requests), tokens/s of each;
- batch 1 (``batch1_report``): prompt processing (a ``PP_TOKENS``-token prompt from an empty
  context) and decoding (``DECODE_TOKENS`` tokens after a short prompt, the first not counted),
  tokens/s of each, the median of ``REPEATS``; tandem's prompts each under a cache salt of their
  own, so that its prefix cache cannot help.

Both sides use the same threads (tandem's torch threads). The two never run at once.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.peers import llamacpp_driver as driver
from tandem.bench.peers import peer_env
from tandem.bench.workload import ModeResult, Workload
from tandem.config import ConfigError

name = "llamacpp"
"""The peer's mode name in the report (``tandem.bench.offline.Peer``)."""
PP_TOKENS = 256
DECODE_PROMPT_TOKENS = 16
DECODE_TOKENS = 128
REPEATS = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--llamacpp-python`` (``--baseline`` is tandem.bench.cli's)."""
    p.add_argument("--llamacpp-python", metavar="PATH", default=None,
                   help="the python of a venv with llama-cpp-python (scripts/make_llamacpp_venv.sh "
                        "makes .venv-llamacpp; then .venv-llamacpp/bin/python)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ``ConfigError`` unless the baseline can run: a .gguf ``--model`` (a file or a
    registry name) and ``--llamacpp-python`` naming a python that finds llama_cpp."""
    from tandem.bench.checkpoint import model_path
    from tandem.models.gguf_file import is_gguf

    if not args.llamacpp_python:
        raise ConfigError("--baseline llamacpp needs --llamacpp-python PATH, the python of a venv with "
                          "llama-cpp-python (scripts/make_llamacpp_venv.sh builds one; then "
                          ".venv-llamacpp/bin/python)")
    if not is_gguf(model_path(args.model)):
        raise ConfigError(f"--baseline llamacpp runs llama.cpp on the same GGUF file: --model {args.model} "
                          "is not one (give a .gguf file or a registry name such as smollm2-135m-instruct)")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"
    try:
        found = subprocess.run([args.llamacpp_python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except OSError as exc:
        raise ConfigError(f"--llamacpp-python {args.llamacpp_python}: cannot run it ({exc})") from exc
    if not found:
        raise ConfigError(f"--llamacpp-python {args.llamacpp_python}: that python has no llama_cpp "
                          "(scripts/make_llamacpp_venv.sh builds a venv with it)")


def batch1_prompts(wl: Workload, pp_tokens: int = PP_TOKENS) -> tuple[list[int], list[int]]:
    """(the prompt-processing prompt, the decode prompt): the workload's own token ids, repeated
    as needed to reach ``pp_tokens``."""
    ids = [t for p in wl.prompts for t in p]
    ids = (ids * (pp_tokens // max(len(ids), 1) + 1))[:pp_tokens]
    return ids, ids[-DECODE_PROMPT_TOKENS:]


def batch1_sizes(max_model_len: int) -> tuple[int, int]:
    """(prompt-processing tokens, decode tokens): ``PP_TOKENS`` and ``DECODE_TOKENS`` within the
    model's context."""
    return min(PP_TOKENS, max_model_len - 1), min(DECODE_TOKENS, max_model_len - DECODE_PROMPT_TOKENS)


def _drive(args: argparse.Namespace, model: str, wl: Workload, sizes: tuple[int, int] | None = None) -> dict:
    """The driver over ``wl``'s requests, or with ``sizes`` (``batch1_sizes``) over batch 1."""
    import torch

    pp_tokens, decode_tokens = sizes or (PP_TOKENS, 4)
    pp_prompt, decode_prompt = batch1_prompts(wl, pp_tokens)
    longest = max((len(p) + m for p, m in zip(wl.prompts, wl.max_tokens)), default=0)
    workload = {"model": model, "threads": torch.get_num_threads(),
                "n_ctx": max(longest, pp_tokens, DECODE_PROMPT_TOKENS + decode_tokens) + 16,
                "prompts": [] if sizes else wl.prompts, "max_tokens": [] if sizes else wl.max_tokens,
                "pp_prompt": pp_prompt if sizes else [], "decode_prompt": decode_prompt,
                "decode_tokens": decode_tokens, "repeats": REPEATS if sizes else 0}
    with tempfile.TemporaryDirectory(prefix="tandem-llamacpp-") as tmp:
        workload_path, result_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        workload_path.write_text(json.dumps(workload))
        sys.stdout.flush()
        done = subprocess.run([args.llamacpp_python, driver.__file__, str(workload_path), str(result_path)],
                              env=peer_env())
        if done.returncode != 0:
            raise RuntimeError(f"the llama.cpp driver exited with {done.returncode} (its output is above)")
        return json.loads(result_path.read_text())


def run(args: argparse.Namespace, model: str, wl: Workload) -> ModeResult:
    """llama.cpp over the workload's requests, one after another, on ``model`` (the .gguf file)."""
    result = _drive(args, model, wl)
    print(f"  llamacpp: llama-cpp-python {result['version']}, loaded and warmed up in {result['load_s']:.1f} s "
          "(not timed); it serves one request at a time, so the requests ran one after another")
    return ModeResult(name, result["seconds"], result["outputs"])


def warm_up_tandem(llm, wl: Workload) -> None:
    """The untimed warm-up llama.cpp gets too: one short greedy generation."""
    from tandem import SamplingParams

    llm.generate([batch1_prompts(wl)[1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def tandem_batch1(llm, wl: Workload, sizes: tuple[int, int]) -> tuple[float, float]:
    """tandem's (prompt tok/s, decode tok/s) at batch 1, as the module doc says."""
    from tandem import SamplingParams

    pp_tokens, decode_tokens = sizes
    pp_prompt, decode_prompt = batch1_prompts(wl, pp_tokens)
    salt = iter(range(10 ** 6))

    def timed(prompt: list[int], n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": f"batch1-{next(salt)}"}],
                     SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t0

    pp = statistics.median(len(pp_prompt) / timed(pp_prompt, 1) for _ in range(REPEATS))
    decode = statistics.median((decode_tokens - 1) / (timed(decode_prompt, decode_tokens) - timed(decode_prompt, 1))
                               for _ in range(REPEATS))
    return pp, decode


def batch1_report(args: argparse.Namespace, llm, model: str, wl: Workload) -> None:
    """Batch-1 prompt processing and decoding of tandem and llama.cpp, side by side."""
    sizes = batch1_sizes(llm.engine.max_model_len)
    ours = tandem_batch1(llm, wl, sizes)
    theirs = _drive(args, model, wl, sizes)
    print(f"\nbatch 1 (median of {REPEATS}; a {sizes[0]}-token prompt, {sizes[1]} decode tokens)")
    print("                          tandem   llama.cpp   tandem / llama.cpp")
    for label, mine, peer in (("prompt processing tok/s", ours[0], theirs["pp_tok_s"]),
                              ("decode tok/s", ours[1], theirs["decode_tok_s"])):
        print(f"{label:<24} {mine:8.1f}   {peer:9.1f}   {mine / peer:8.2f}x")
