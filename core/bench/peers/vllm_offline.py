"""vLLM as a baseline of ``tandem bench offline``, measured in the same run (``--baseline vllm``).

vLLM lives in a venv of its own (``scripts/make_vllm_venv.sh``), given by ``--vllm-python``. Its
side is ``tandem/bench/peers/vllm_offline_driver.py``, run as a file by that python: this module writes
the workload (the very prompt token ids and output lengths tandem gets, the model, the dtype and
tandem's batch limits) to a JSON file, runs the driver and reads its outputs and wall time back as
a ``ModeResult`` named ``vllm``. The two never run at once: they share the cores. Both are warmed
up, untimed, on the workload's prompts reversed for ``WARMUP_TOKENS`` tokens each first (each compiles on the first batches
of new shapes: vLLM with inductor, tandem in its attention path), so that neither's compilation
counts.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.bench.peers import peer_env
from tandem.bench.peers import vllm_offline_driver as driver
from tandem.bench.workload import ModeResult, Workload
from tandem.config import ConfigError

name = "vllm"
"""The peer's mode name in the report (``tandem.bench.offline.Peer``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--vllm-python`` (``--baseline`` is tandem.bench.cli's, over every peer of a benchmark)."""
    p.add_argument("--vllm-python", metavar="PATH", default=None,
                   help="the python of a venv with vLLM's CPU build (scripts/make_vllm_venv.sh "
                        "makes .venv-vllm; then .venv-vllm/bin/python)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raises ``ConfigError`` unless the baseline can run: ``--baseline vllm`` needs
    ``--vllm-python`` naming a python that can import vllm (found, not imported: seconds saved)."""
    if args.baseline is None:
        return
    if not args.vllm_python:
        raise ConfigError("--baseline vllm needs --vllm-python PATH, the python of a venv with "
                          "vLLM (scripts/make_vllm_venv.sh builds one; then .venv-vllm/bin/python)")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        found = subprocess.run([args.vllm_python, "-c", probe], capture_output=True,
                               timeout=60).returncode == 0
    except OSError as exc:
        raise ConfigError(f"--vllm-python {args.vllm_python}: cannot run it ({exc})") from exc
    if not found:
        raise ConfigError(f"--vllm-python {args.vllm_python}: that python has no vllm "
                          "(scripts/make_vllm_venv.sh builds a venv with it)")


def write_workload(path: Path, wl: Workload, model: str, dtype: str, max_num_seqs: int,
                   max_num_batched_tokens: int, seed: int) -> None:
    """The workload file ``vllm_offline_driver.load_workload`` reads."""
    path.write_text(json.dumps({"model": model, "dtype": dtype, "prompts": wl.prompts,
                                "max_tokens": wl.max_tokens, "max_num_seqs": max_num_seqs,
                                "max_num_batched_tokens": max_num_batched_tokens, "seed": seed}))


def read_result(path: Path) -> tuple[ModeResult, dict]:
    """The driver's result file as a ``ModeResult`` named ``vllm``, and the rest of the file."""
    result = json.loads(path.read_text())
    return ModeResult("vllm", result.pop("seconds"), result.pop("outputs")), result


def run(args: argparse.Namespace, model: str, wl: Workload) -> ModeResult:
    """Runs the driver under ``--vllm-python`` on this workload (``model``: tandem's path; a
    .gguf file goes to vLLM as its dequantized folder); its output streams through."""
    from tandem.bench.checkpoint import hf_folder

    model = hf_folder(model)
    with tempfile.TemporaryDirectory(prefix="tandem-vllm-") as tmp:
        workload_path, result_path = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        write_workload(workload_path, wl, model, args.dtype, args.max_num_seqs,
                       args.max_num_batched_tokens, args.seed)
        sys.stdout.flush()
        done = subprocess.run([args.vllm_python, driver.__file__, str(workload_path),
                               str(result_path)], env=peer_env())
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM driver exited with {done.returncode} (its output is above)")
        result, extra = read_result(result_path)
    print(f"  vllm: LLM built and warmed up in {extra['load_s']:.1f} s (not timed)")
    return result


def warm_up_tandem(llm, wl: Workload) -> None:
    """The untimed warm-up the driver gives vLLM (``vllm_offline_driver.warmup_prompts``)."""
    from tandem import SamplingParams

    t0 = time.perf_counter()
    llm.generate(driver.warmup_prompts(wl.prompts), SamplingParams(temperature=0.0, max_tokens=driver.WARMUP_TOKENS,
                                            ignore_eos=True))
    print(f"  tandem: warmed up in {time.perf_counter() - t0:.1f} s (not timed)", flush=True)
